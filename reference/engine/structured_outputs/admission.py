"""Requests whose grammar is still compiling wait here, not in the scheduler's queue.

A grammar seen before is compiled already (a dictionary lookup): its request joins the scheduler
at once. A new one is compiled on the compiler's thread (``grammar.BackgroundCompiler``), and
its request waits in this room until the compile is done, so the running requests' steps never
wait for a compile. Before each step the engine lets the ready ones in, in arrival order; a
compile that failed finishes its request with finish_reason "error".
"""

from concurrent.futures import FIRST_COMPLETED, Future, wait

from ..sequence import SequenceGroup, SequenceStatus
from ..validation import FieldValueError
from .grammar import BackgroundCompiler
from .params import FIELD


class GrammarAdmission:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.compiler: BackgroundCompiler | None = None  # built by the first grammar
        self.compiling: list[tuple[SequenceGroup, Future]] = []

    def __len__(self) -> int:
        return len(self.compiling)  # requests waiting for their grammar

    # --8<-- [start:compile]
    def check(self, params, tokenizer, eos_token_id: int | None):
        """A request's structured outputs: None without; the compiled grammar if it
        is cached (a dictionary lookup); else the Future of its compile on the
        compiler's thread, which does not hold up the running requests' steps."""
        spec = getattr(params, "structured_outputs", None)
        if spec is None:
            return None
        if tokenizer is None or eos_token_id is None:
            raise FieldValueError(FIELD, "structured outputs need the model's tokenizer "
                                  "and its EOS token; this model folder has none")
        if self.compiler is None:  # the vocabulary's tables, built once
            self.compiler = BackgroundCompiler(tokenizer, self.vocab_size, eos_token_id)
        compiled = self.compiler.lookup(spec)
        return compiled if compiled is not None else self.compiler.submit(spec)
    # --8<-- [end:compile]

    def add(self, group: SequenceGroup, grammar, scheduler) -> None:
        """The request joins the scheduler, or waits here for its grammar (what ``check``
        returned)."""
        if isinstance(grammar, Future):
            self.compiling.append((group, grammar))
            return
        if grammar is not None:
            self._set_grammar(group, grammar)
        scheduler.add(group)

    def _set_grammar(self, group: SequenceGroup, grammar) -> None:
        group.grammar = grammar
        group.seqs[0].matcher = self.compiler.matcher(grammar)  # at the grammar's start

    def admit_compiled(self, scheduler) -> list[SequenceGroup]:
        """Requests whose grammar is compiled join the scheduler (in arrival order); with
        nothing else to run, wait a little for one. Returns the requests whose compile
        failed: they are finished with finish_reason "error"."""
        if not self.compiling:
            return []
        if not scheduler.has_unfinished():
            wait([f for _, f in self.compiling], timeout=0.01, return_when=FIRST_COMPLETED)
        failed, still = [], []
        for group, future in self.compiling:
            if not future.done():
                still.append((group, future))
            elif future.exception() is not None:
                group.seqs[0].status = SequenceStatus.FINISHED
                group.seqs[0].finish_reason = "error"
                failed.append(group)
            else:
                self._set_grammar(group, future.result())
                scheduler.add(group)
        self.compiling = still
        return failed

    def remove(self, group: SequenceGroup) -> None:
        """An aborted request stops waiting (its compile, if running, is left to finish)."""
        self.compiling = [(g, f) for g, f in self.compiling if g is not group]

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()
