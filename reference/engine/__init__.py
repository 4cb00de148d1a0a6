"""The engine: requests in, tokens out. Sequence groups and their sampling parameters, the
scheduler (continuous batching, budgets, preemption, chunked prefill, static batching), the
step's inputs as tensors, the configuration (EngineArgs, checked once), the model runner (the
seam to model execution), the step itself (LLMEngine), beam search, stop checks, incremental
detokenization, and LLM, the offline entry point. The one package that sees every other."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .config import EngineArgs, EngineConfig
from .engine import LLMEngine
from .generate import generate, generate_many
from .llm import LLM
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput
from .request_checks import check_prompt
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .step_inputs import StepInputs, prepare_inputs
from .structured_outputs import StructuredOutputsParams

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
           "EngineArgs", "EngineConfig", "LLM", "LLMEngine", "ModelRunner", "RequestOutput",
           "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepInputs",
           "StructuredOutputsParams", "check_prompt", "generate", "generate_many", "prepare_inputs"]
