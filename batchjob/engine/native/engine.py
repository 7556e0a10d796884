"""batchjob's own engine: `engine=native` (asynchronous double-slot loop) and `engine=native_sync`.

The loop reads like the design: pull requests while there is room -> schedule step N+1 -> launch it -> collect
step N's tokens (the GPU is already busy with N+1) -> update sequences, emit finished requests. With
`async_loop=False` each step is collected right after its launch, so the CPU and GPU take turns. Requests
are admitted sorted by prompt within a bounded look-ahead window (admission.py). The engine's start-up
(engine_start.py) ends with a warm-up of every kind of step (warmup.py).

Structured outputs: a step with constrained rows is launched as its forward only; once step N's tokens have advanced
the matchers, step N+1's bitmasks are filled and its sampler enqueued (split_steps.py says why; step_masks.py fills
them). In the asynchronous loop a worker thread advances the matchers by N's tokens while this thread applies N's
unconstrained rows (output.py), then fills the bitmasks (llguidance computes both off the GIL, in its own threads)
while this thread processes the rest of step N, admits, schedules and fills step N+2; between those pieces of work
it polls, and enqueues step N+1's sampler at the first poll that finds the masks filled, then step N+2's forward
once it is laid out, so the GPU waits for neither the scheduler nor the host's step filling:

    loop:   process N (poll) | schedule (poll) | sampler N+1 | fill N+2 | forward N+2 | wait N+1 | process N+1
    worker:    masks N+1 .........|
    GPU:   forward N+1 .................| sampler N+1 | forward N+2 ..................

On a GPU whose driver has stream memory operations (`engine.gate_masked_sampler`, host_gate.py), the loop
enqueues the sampler as it hands the masks to the worker, behind a wait that the worker opens when they are
filled, and step N+2's forward as soon as it is laid out: the GPU goes from the masks to the sampler to the next
forward without a host call between.

    loop:   process N (sampler N+1) | schedule | fill N+2 | forward N+2 | wait N+1 | process N+1
    worker:    advance N, masks N+1 .......| open
    GPU:   forward N+1 ....................| sampler N+1 | forward N+2 ..................
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from batchjob.engine.api import Completion, Request
from batchjob.engine.devices import device_kind, torch_device
from batchjob.engine.grammar import GrammarError
from batchjob.engine.native.engine_start import check_gpu_count, start_on_device, start_ranks
from batchjob.engine.native.engine_stats import constrained_stats, step_stats
from batchjob.engine.native.layers import parallel
from batchjob.engine.native.models import spec_check
from batchjob.engine.native.options import NativeOptions
from batchjob.engine.native.output import OutputProcessor
from batchjob.engine.native.runtime.step_handle import PreparedStep, StepHandle
from batchjob.engine.native.scheduling.admission import AdmissionQueue, refusal
from batchjob.engine.native.scheduling.block_manager import KVBlockManager
from batchjob.engine.native.scheduling.plan import StepPlan
from batchjob.engine.native.scheduling.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.native.scheduling.sequence import RequestGroup, Sequence
from batchjob.engine.native.step_masks import StepMasks

if TYPE_CHECKING:
    from batchjob.engine.native.executor.rank_group import RankGroup

log = logging.getLogger("batchjob.engine.native")


class NativeEngine:
    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        NativeOptions.from_mapping(options)

    @classmethod
    def check_model(cls, model_path: str, options: Mapping[str, Any]) -> str:
        """The architecture the engine will run, from the model's config files alone. Raises
        `UnsupportedModelError` when the native engine cannot run the model, or `ValueError` when the options
        do not fit it (max_model_len beyond the model's) or this machine (a GPU it does not have)."""
        from batchjob.engine.native.loading.model_loader import read_model_spec
        from batchjob.engine.native.loading.sharding import check_tensor_parallel
        from batchjob.engine.native.models.spec import check_batch_invariant

        opts = NativeOptions.from_mapping(options)
        try:
            with spec_check.checking(device_kind(opts.device)):  # the engine this process starts verifies it
                spec = read_model_spec(
                    model_path, opts.dtype, opts.max_model_len, opts.quantization, opts.kv_cache_dtype
                )
            check_tensor_parallel(spec, opts.tensor_parallel)
            if opts.deterministic:
                check_batch_invariant(spec)
            check_gpu_count(opts)
            torch_device(opts.device)
        except BaseException:
            spec_check.discard()  # no engine will verify it (engine=auto may fall back to another backend)
            raise
        return spec.architecture

    def __init__(self, model_path: str, **options: Any) -> None:
        self.options = NativeOptions.from_mapping(options)
        self._spec_checks: list[spec_check.SpecCheck] = []
        self._verified: list[spec_check.SpecCheck] = []  # taken by `generate` or `settle`: their timings
        # A model spec missing from the cache is read without transformers, and checked against transformers'
        # reading in a process beside the start-up; `generate` hands on nothing before it has passed
        # (models/spec_check.py), so the check need not end before the engine is ready.
        try:
            with spec_check.checking(device_kind(self.options.device)):
                self._start(model_path)
        except BaseException:
            spec_check.discard()
            raise
        self._spec_checks = spec_check.take()

    def _start(self, model_path: str) -> None:
        opts = self.options
        if opts.tensor_parallel > 1 and not parallel.current().active:
            check_gpu_count(opts)
            started = start_ranks(model_path, opts)
        else:
            started = start_on_device(model_path, opts)
        self.device, self.spec, self.runner = started.device, started.spec, started.runner
        self.ranks: RankGroup | None = started.ranks
        self.model, self.kv_caches = started.model, started.kv_caches
        self.grammars, self.tokenizer = started.grammars, started.tokenizer
        self.max_model_len = self.spec.max_model_len
        self._stats: dict[str, float] = started.stats
        self._start_loop(started.num_blocks)

    def _start_loop(self, num_blocks: int) -> None:
        opts = self.options
        self.blocks = KVBlockManager(num_blocks, opts.block_size, opts.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=opts.max_num_seqs,
                max_num_batched_tokens=opts.max_num_batched_tokens,
                enable_chunked_prefill=opts.enable_chunked_prefill,
                constrained_lag=opts.constrained_lag and opts.async_loop,
                token_buckets=tuple(self.runner.graph_buckets.mixed),
                decode_rows=self.runner.graph_buckets.decode_rows,
            ),
            self.blocks,
        )
        self._next_seq_id = 0
        # The loop thread's own host work, in seconds: admitting requests, scheduling steps, processing their
        # tokens (with the caller's handling of the completions it yields)
        self.admit_s = self.schedule_s = self.process_s = 0.0
        self._froze = False  # the garbage collector's freeze of start-up objects, at the first run
        if self.grammars.tokenizer is None:
            self.grammars.tokenizer = self.tokenizer
        self.outputs = OutputProcessor(
            self.tokenizer, self.spec.eos_token_ids, opts.detokenize, self.grammars, opts.jump_forward
        )
        self.masks = StepMasks(
            self.runner,
            self.grammars,
            chunked=self.options.chunked_masks,
        )

    # ---- the loop ----

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        completions = self._generate(requests)
        checks, self._spec_checks = self._spec_checks, []
        self._verified.extend(checks)
        return spec_check.held_until_verified(checks, completions) if checks else completions

    def _generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        queue = AdmissionQueue(requests, self.options.admission_window)
        exhausted = False
        inflight: deque[StepHandle] = deque()
        depth = 1 if self.options.async_loop else 0
        idle_rounds = 0
        finished = False
        # A full garbage collection scans every object the process holds, about 0.1 s with torch and transformers
        # imported, and stalls the GPU when it falls mid-run (146 ms between two steps, measured). What exists
        # at the first run (imports, the model) lives as long as the engine: frozen, so collections scan only
        # what runs create; close unfreezes. Once only: a caller's later garbage stays collectable.
        if not self._froze:
            gc.freeze()
            self._froze = True
        try:
            while True:
                began = time.perf_counter()
                while not exhausted and self.scheduler.free_seq_slots > 0:
                    request = queue.pop()
                    if request is None:
                        exhausted = True
                        break
                    refused = self._admit(request)
                    if refused is not None:
                        yield refused
                self.admit_s += time.perf_counter() - began
                # Between pieces of this thread's work, a filled bitmask's sampler goes to the GPU (step_masks.py).
                self.masks.poll()
                began = time.perf_counter()
                plan = self.scheduler.schedule()
                self.schedule_s += time.perf_counter() - began
                self.masks.poll()
                if plan is not None:
                    prepared = self._prepare(plan)
                    if not self.masks.gated:
                        # The previous step's masked sampler first: this step's forward carries its tokens over
                        # (a gated one is on the GPU already, while the worker fills its masks).
                        self.masks.finish()
                    inflight.append(self._launch(prepared))
                    lag = self.scheduler.config.constrained_lag and not self.masks.busy
                    if lag and self.masks.matchers_settled(inflight[-1]):
                        # Its constrained rows sat out the step in flight: their masks fill while this thread
                        # processes that step and prepares the next.
                        self.masks.start(inflight[-1], at_launch=True)
                # Async: keep one step in flight while this one's results are processed.
                while len(inflight) > (depth if plan is not None else 0):
                    step = inflight.popleft()
                    began = time.perf_counter()
                    yield from self._process(step, inflight[0] if inflight else None)
                    self.process_s += time.perf_counter() - began
                if inflight and not inflight[-1].sampled and not self.masks.busy:
                    # Every step before it is processed: its constrained rows' masks can be computed now, by the
                    # worker, while this thread prepares the next step.
                    self.masks.start(inflight[-1])
                if plan is None and not inflight:
                    if not self.scheduler.has_unfinished:
                        if exhausted:
                            break
                    elif idle_rounds > 0:
                        # Nothing in flight and the previous round freed all it could: nothing can ever run.
                        raise RuntimeError(
                            f"scheduler stalled: {len(self.scheduler.waiting)} waiting, "
                            f"{len(self.scheduler.running)} running, {self.blocks.num_free} free blocks"
                        )
                    idle_rounds += 1
                else:
                    idle_rounds = 0
            finished = True
            self.blocks.check_invariants()
        finally:
            self.masks.abandon()  # stopped early: the worker may still hold matchers
            self.runner.finish()
            if not finished:
                # The caller stopped early (a signal, an error): drop every request in flight so the engine
                # can serve a new `generate` call from a clean state.
                self._reset_scheduler()

    def _reset_scheduler(self) -> None:
        self.blocks = KVBlockManager(self.blocks.num_blocks, self.blocks.block_size, self.options.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler.config, self.blocks)

    def _admit(self, request: Request) -> Completion | None:
        prompt_len = len(request.prompt_ids)
        sampling = request.sampling
        error = refusal(
            request,
            self.max_model_len,
            self.spec.vocab_size,
            detokenize=self.options.detokenize,
            tensor_parallel=self.options.tensor_parallel if self.ranks is not None else 1,
        )
        if error is not None:
            return Completion.failed(request.id, prompt_len, error)
        matchers = []
        if sampling.constraint is not None:
            try:
                matchers = [self.grammars.matcher(sampling.constraint) for _ in range(sampling.n)]
            except GrammarError as err:
                return Completion.failed(request.id, prompt_len, str(err))
        group = RequestGroup(request=request, prompt_len=prompt_len)
        max_len = min(prompt_len + sampling.max_new_tokens, self.max_model_len)
        base_seed = self.options.seed if sampling.seed is None else sampling.seed
        for index in range(sampling.n):
            seq = Sequence.create(
                self._next_seq_id,
                group,
                index,
                max_len,
                # Distinct, reproducible streams for the n samples of one request.
                base_seed * 1_000_003 + index,
                self.options.block_size,
            )
            self._next_seq_id += 1
            seq.matcher = matchers[index] if matchers else None
            group.sequences.append(seq)
            self.scheduler.add(seq)
        return None

    def _prepare(self, plan: StepPlan) -> PreparedStep | StepPlan:
        # The ranks of a tensor-parallel engine lay steps out themselves, and never have a mask to wait for.
        return plan if self.ranks is not None else self.runner.prepare(plan)

    def _launch(self, prepared: PreparedStep | StepPlan) -> StepHandle:
        if self.ranks is not None:
            return self.runner.launch(prepared)
        return self.runner.launch_prepared(prepared)

    def _process(self, step: StepHandle, follower: StepHandle | None = None) -> Iterator[Completion]:
        """Apply `step`'s tokens. `follower`, the step in flight after it: with `engine.mask_chunk_rows`, its
        masks fill chunk by chunk as this step's rows settle their matchers (step_masks.py)."""
        if not step.sampled:
            if self.masks.holds(step):
                self.masks.finish()
            else:
                self.masks.fill_now(step)
        settle = advanced = None
        if follower is not None and not follower.sampled and not self.masks.busy:
            if self.options.chunked_masks:
                self.masks.begin(follower, step.plan.seqs)
                settle = self.masks.settle
            elif not self.options.jump_forward:
                # The follower's masks need only this step's tokens in the matchers: the worker advances them and
                # fills the masks while this thread processes the step (jump-forward would need the matchers
                # after that).
                advanced = functools.partial(self.masks.advance_and_start, follower)
        result = self.runner.collect(step)
        yield from self.outputs.process(
            step, result, self.scheduler, settle, self.options.mask_chunk_rows, advanced, self.masks.poll
        )

    def stats(self) -> dict[str, float]:
        runner = self.runner
        loop_s = (self.admit_s, self.schedule_s, self.process_s)
        stats = {**self._stats, **step_stats(runner, self.scheduler, self.outputs, loop_s, self.options.max_num_seqs)}
        if runner.masked_steps:
            stats.update(constrained_stats(runner, self.masks, self.outputs, self.grammars))
        stats.update(spec_check.timings(self._verified))
        if runner.clock is not None and runner.clock.fraction() is not None:
            stats["gpu_busy_fraction"] = runner.clock.fraction()
        if self.ranks is not None:
            stats.update(self.ranks.stats())
        return stats

    def tokens_generated(self) -> int:
        return self.outputs.tokens_out + self.outputs.forced_tokens

    def busy_timeline(self) -> list[tuple[float, float]]:
        """(start, end) seconds of the first few thousand steps' compute on the GPU (empty on CPU)."""
        return list(self.runner.clock.timeline) if self.runner.clock is not None else []

    def settle(self) -> None:
        checks, self._spec_checks = self._spec_checks, []
        self._verified.extend(checks)
        spec_check.verify(checks)  # a difference is a setup error (`SpecCheckError`)

    def close(self) -> None:
        spec_check.stop(self._spec_checks)  # neither generated nor settled: the checks end unverified
        self._spec_checks = []
        self.masks.close()
        self.grammars.close()
        if self.ranks is not None:
            self.ranks.close()
        self.kv_caches = []
        self.runner = None
        if self._froze:
            gc.unfreeze()
        if self.device.type == "cuda":
            gc.collect()  # whatever still holds device memory through a reference cycle goes before the cache
            torch.cuda.empty_cache()
