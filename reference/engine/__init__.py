"""The engine: requests in, tokens out. Sequence groups and their sampling parameters, the
scheduler (continuous batching, budgets, preemption, chunked prefill, static batching), the
step's inputs as tensors, the configuration (EngineArgs, checked once), the model runner (the
seam to model execution, and the factory that picks it), the step itself (LLMEngine), the
scheduler's post-step helpers (output processing, beam search's step, stop checks, incremental
detokenization), structured outputs, the engine client protocol a front end uses, and LLM, the
offline entry point. The one package that sees every other."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .client import EngineClient, ModelLimits
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
           "EngineArgs", "EngineClient", "EngineConfig", "LLM", "LLMEngine", "ModelLimits",
           "ModelRunner", "RequestOutput",
           "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepInputs",
           "StructuredOutputsParams", "check_prompt", "generate", "generate_many", "prepare_inputs"]
