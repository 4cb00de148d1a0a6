"""The engine: requests in, tokens out. Sequence groups and their sampling parameters, the
scheduler (continuous batching, budgets, preemption, chunked prefill, static batching), the
step's inputs as tensors, the step itself (LLMEngine), beam search, stop checks, incremental
detokenization, and LLM, the offline entry point. The one package that sees every other."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .engine import LLMEngine, check_prompt
from .generate import generate, generate_many
from .llm import LLM
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .step_inputs import StepInputs, prepare_inputs

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
           "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "StepInputs", "check_prompt", "generate", "generate_many",
           "prepare_inputs"]
