"""vLLM as a batchjob backend (`engine=vllm`, the `batchjob[vllm]` extra).

The job keeps what it does for every backend (exactly-once Parquet output, resume, shards, Slurm arrays); vLLM
runs the requests. They are fed to vLLM's `LLMEngine` a window at a time (twice its `max_num_seqs`, so its
scheduler always has work) and each completion is handed back as soon as vLLM finishes it, so a preempted job
loses only what was in flight. Prompts go in as token ids (the job tokenizes and applies chat templates);
sampling settings, stop strings, log-probabilities, `n`, per-row seeds and structured outputs map onto vLLM's
(`vllm_options.py`). `engine.deterministic` turns on vLLM's batch-invariant mode (`VLLM_BATCH_INVARIANT=1`).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from batchjob.caches import use_vllm_cache
from batchjob.engine.api import FINISH_LENGTH, FINISH_STOP, Completion, EngineSetupError, Request, Sample
from batchjob.engine.vllm_options import (
    NO_DEVICE,
    OPTION_DEFAULTS,
    check_options,
    engine_kwargs,
    sampling_kwargs,
    vllm_device,
)
from batchjob.engine.weight_files import check_local_weight_files
from batchjob.processes import descendants, reap_when_gone, stop

# vLLM's finish reasons -> batchjob's ("abort" only when a request is cancelled, which batchjob never does)
FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH}


class VLLMEngine:
    """`VLLMEngine(model_path, **options)`: `vllm_options.OPTION_DEFAULTS` and any of vLLM's `EngineArgs`."""

    @classmethod
    def check_model(cls, model_path: str, options: Mapping[str, Any]) -> None:
        """Refuse weight files that cannot load from their headers; which architectures vLLM runs is vLLM's
        to say as it starts."""
        if not vllm_device():
            raise ValueError(NO_DEVICE)
        if options.get("load_format", "auto") != "dummy":
            check_local_weight_files(model_path)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_options(options)

    def __init__(self, model_path: str, **options: Any) -> None:
        self.check_options(options)
        opts = {**OPTION_DEFAULTS, **options}
        if opts["deterministic"]:
            os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read as vLLM starts, in its engine process too
        use_vllm_cache()
        from vllm import LLM

        started = time.perf_counter()
        ours = set(descendants(os.getpid()))  # processes this one had already (a notebook's own, say)
        try:
            self.llm = LLM(**engine_kwargs(model_path, opts))
        except Exception as err:  # before any request: vLLM's log above holds its engine process's own account
            raise EngineSetupError(
                f"vLLM did not start: {type(err).__name__}: {err} (its log above says why; GPU memory that another "
                "process holds: free it, or lower engine.gpu_memory_utilization)"
            ) from err
        # vLLM's engine runs in processes of its own: a job killed with SIGKILL must not leave them on the GPU.
        self._reaper = reap_when_gone([pid for pid in descendants(os.getpid()) if pid not in ours])
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.window = 2 * int(self.engine.vllm_config.scheduler_config.max_num_seqs)
        self.detokenize = opts["detokenize"]
        self._ids = itertools.count()
        self._stats = {"startup_s": time.perf_counter() - started, "steps": 0, "generated_tokens": 0, "wall_s": 0.0}

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    def tokens_generated(self) -> int:
        """Tokens of finished requests."""
        return int(self._stats["generated_tokens"])

    def settle(self) -> None:
        """Nothing is checked beside this engine's start-up."""

    def close(self) -> None:
        engine_core = getattr(self.engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()  # its process would otherwise keep the GPU's memory
        stop(self._reaper)
        self._reaper = None
        self.llm = self.engine = None

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        started = time.perf_counter()
        pending = iter(requests)
        in_flight: dict[str, Request] = {}
        try:
            while True:
                while len(in_flight) < self.window and (request := next(pending, None)) is not None:
                    refusal = self._refusal(request) or self._submit(request, in_flight)
                    if refusal is not None:
                        yield Completion.failed(request.id, len(request.prompt_ids), refusal)
                if not in_flight:
                    return
                outputs = self.engine.step()
                self._stats["steps"] += 1
                for output in outputs:
                    if output.finished:
                        yield self._completion(in_flight.pop(output.request_id), output)
        finally:
            for request_id in in_flight:  # a consumer that stopped early (a signal): free vLLM's slots
                self.engine.abort_request([request_id])
            self._stats["wall_s"] += time.perf_counter() - started

    def _submit(self, request: Request, in_flight: dict[str, Request]) -> str | None:
        """Hand `request` to vLLM and note it in `in_flight`; or vLLM's refusal of it (its constraint, its length)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams

        kwargs = {**sampling_kwargs(request.sampling), "detokenize": self.detokenize}
        if "structured_outputs" in kwargs:
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        request_id = str(next(self._ids))
        try:
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
            self.engine.add_request(request_id, prompt, SamplingParams(**kwargs))
        except ValueError as err:
            return f"vLLM refused the request: {err}"
        in_flight[request_id] = request
        return None

    def _refusal(self, request: Request) -> str | None:
        if len(request.prompt_ids) == 0:
            return "empty prompt: nothing to generate from"
        if len(request.prompt_ids) >= self.max_model_len:
            return f"prompt has {len(request.prompt_ids)} tokens, the model context is {self.max_model_len}"
        if request.sampling.stop and not self.detokenize:
            return "stop strings need text: the engine runs with engine.detokenize=false"
        return None

    def _completion(self, request: Request, output: Any) -> Completion:
        k = request.sampling.logprobs
        samples = []
        for sample in sorted(output.outputs, key=lambda s: s.index):
            token_ids = tuple(sample.token_ids)
            self._stats["generated_tokens"] += len(token_ids)
            chosen = top = None
            if k is not None and sample.logprobs is not None:
                chosen = tuple(
                    float(step[token].logprob) for token, step in zip(token_ids, sample.logprobs, strict=True)
                )
                top = tuple(
                    {token: float(lp.logprob) for token, lp in step.items() if lp.rank is not None and lp.rank <= k}
                    for step in sample.logprobs
                )
            reason = FINISH_REASONS.get(sample.finish_reason, FINISH_LENGTH)
            samples.append(Sample(token_ids, sample.text, reason, chosen, top))
        return Completion(id=request.id, samples=tuple(samples), prompt_tokens=len(request.prompt_ids))
