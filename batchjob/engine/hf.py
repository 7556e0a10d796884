"""The Hugging Face transformers backend (`engine=hf`): the reference and performance peer.

Requests are pulled lazily in windows of `max_batch_size * lookahead`, sorted by prompt length (so left
padding stays small) and run as static micro-batches through the model's own forward with a KV cache.
The decode loop is ours rather than `model.generate` because the contract needs things `generate`
cannot give: a reproducible random stream per request (so a resumed job samples exactly as an
uninterrupted one), per-request length limits, and stop strings trimmed out of the text. Memory is
bounded explicitly: a micro-batch holds at most `max_batch_tokens` KV positions.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import Any

import torch

from batchjob.engine.api import Completion, EngineSetupError, Request, Sample, SamplingParams
from batchjob.engine.devices import torch_device
from batchjob.engine.grammar import GrammarCompiler, GrammarError
from batchjob.engine.hf_options import OPTION_DEFAULTS, check_options
from batchjob.engine.hf_sampling import RowState, choose_tokens, constraint_mask
from batchjob.engine.transformers_import import from_transformers
from batchjob.engine.weight_files import check_local_weight_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: transformers renamed `past_key_values` to `cache` (5.24 has
    `cache` and warns on the old name, 5.17 has only `past_key_values`). A name forward() does not list would
    vanish into **kwargs and run without a cache, so it is read from the signature, never guessed."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`: engine=hf needs one")


def _load_model(model_path: str, dtype: torch.dtype, attention: str | None) -> torch.nn.Module:
    """The model through transformers, whose check of `attention` depends on the model class and what is installed
    (a FlashAttention package, a GPU): its refusal is an `EngineSetupError` naming the option, not a traceback."""
    try:
        return from_transformers("AutoModelForCausalLM").from_pretrained(
            model_path, dtype=dtype, attn_implementation=attention
        )
    except (ImportError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        chosen = attention not in (None, OPTION_DEFAULTS["attn_implementation"])
        if not (chosen and re.search(r"attn|attention", reason, re.IGNORECASE)):
            raise
        raise EngineSetupError(
            f"engine.attn_implementation={attention} cannot run this model here ({reason}): use "
            f"engine.attn_implementation={OPTION_DEFAULTS['attn_implementation']} or eager, or install what it needs"
        ) from err


class HFEngine:
    """`HFEngine(model_path, dtype=, device=, max_batch_size=, max_batch_tokens=, lookahead=,
    max_model_len=, attn_implementation=)`; see `OPTION_DEFAULTS`."""

    @classmethod
    def check_model(cls, model_path: str, options: Mapping[str, Any]) -> None:
        """Refuse weight files that cannot load (a missing shard, a truncated copy) from their headers (a hub id
        is left to transformers, which fetches it), and a device this machine does not have."""
        check_local_weight_files(model_path)
        torch_device(options.get("device", OPTION_DEFAULTS["device"]))

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        check_options(options)

    def __init__(self, model_path: str, **options: Any) -> None:
        self.check_options(options)
        opts = {**OPTION_DEFAULTS, **options}
        self.device = torch_device(opts["device"])
        dtype = opts["dtype"]
        if dtype == "auto":
            # CPU kernels for half types are slow and inexact; GPUs want bf16.
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.tokenizer = from_transformers("AutoTokenizer").from_pretrained(model_path)
        self.model = _load_model(model_path, DTYPES[dtype], opts["attn_implementation"]).to(self.device)
        self.model.eval()
        self._cache_kwarg = cache_keyword(self.model)
        config = self.model.config
        self.max_model_len = int(opts["max_model_len"] or config.max_position_embeddings)
        # engine.deterministic: one request a micro-batch, so a row is never padded or batched with another's
        self.max_batch_size = 1 if opts["deterministic"] else opts["max_batch_size"]
        self.max_batch_tokens = opts["max_batch_tokens"]
        self.window = opts["max_batch_size"] * opts["lookahead"]
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids or (0,))[0]
        self.grammars = GrammarCompiler(self.tokenizer, config.vocab_size, self.eos_token_ids)
        self._stats = {
            "steps": 0,
            "prefill_tokens": 0,
            "generated_tokens": 0,
            "forward_s": 0.0,
            "wall_s": 0.0,
        }

    def stats(self) -> dict[str, float]:
        stats = dict(self._stats)
        if stats["wall_s"] > 0:
            # The forward pass is what keeps the accelerator busy; the rest is Python between steps.
            stats["gpu_busy_fraction"] = stats["forward_s"] / stats["wall_s"]
        return stats

    def tokens_generated(self) -> int:
        """Tokens of finished batches: a static batch's tokens are counted once all its rows are done."""
        return self._stats["generated_tokens"]

    def settle(self) -> None:
        """Nothing is checked beside this engine's start-up."""

    def close(self) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        it = iter(requests)
        while window := list(islice(it, self.window)):
            runnable = []
            for req in window:
                if len(req.prompt_ids) == 0:
                    yield Completion.failed(req.id, 0, "empty prompt: nothing to generate from")
                elif len(req.prompt_ids) >= self.max_model_len:
                    yield Completion.failed(
                        req.id,
                        len(req.prompt_ids),
                        f"prompt has {len(req.prompt_ids)} tokens, the model context is {self.max_model_len}",
                    )
                elif (error := self._constraint_error(req)) is not None:
                    yield Completion.failed(req.id, len(req.prompt_ids), error)
                else:
                    runnable.append(req)
            runnable.sort(key=lambda r: (repr(_batch_kind(r)), -len(r.prompt_ids)))
            for batch in self._micro_batches(runnable):
                yield from self._run_batch(batch)

    def _constraint_error(self, request: Request) -> str | None:
        constraint = request.sampling.constraint
        if constraint is None:
            return None
        try:
            self.grammars.matcher(constraint)  # compiled once and cached; each row gets its own copy later
        except GrammarError as err:
            return str(err)
        return None

    def _micro_batches(self, ordered: list[Request]) -> Iterator[list[Request]]:
        batch: list[Request] = []
        for req in ordered:
            candidate = batch + [req]
            rows = sum(r.sampling.n for r in candidate)
            longest = max(len(r.prompt_ids) for r in candidate)
            kv_positions = rows * (longest + req.sampling.max_new_tokens)
            same_kind = not batch or _batch_kind(batch[0]) == _batch_kind(req)
            if batch and (not same_kind or rows > self.max_batch_size or kv_positions > self.max_batch_tokens):
                yield batch
                batch = [req]
            else:
                batch = candidate
        if batch:
            yield batch

    @torch.inference_mode()
    def _run_batch(self, batch: list[Request]) -> Iterator[Completion]:
        from transformers import DynamicCache

        started = time.perf_counter()
        sampling: SamplingParams = batch[0].sampling
        rows = [RowState.start(req, j, self.max_model_len, self.device) for req in batch for j in range(req.sampling.n)]
        constraint = sampling.constraint
        for row in rows:
            row.matcher = None if constraint is None else self.grammars.matcher(constraint)
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            mask[i, width - len(row.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        step_input = input_ids
        self._stats["prefill_tokens"] += int(mask.sum())
        while True:
            t0 = time.perf_counter()
            out = self.model(
                input_ids=step_input,
                attention_mask=mask,
                position_ids=positions,
                **{self._cache_kwarg: cache},
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1, :].float()
            if self.device.type == "cuda":
                # Sampling syncs right after anyway; syncing here makes forward_s the GPU's time, not launch time.
                torch.cuda.synchronize(self.device)
            self._stats["forward_s"] += time.perf_counter() - t0
            self._stats["steps"] += 1
            allowed = constraint_mask(rows, self.grammars, self.device) if constraint is not None else None
            chosen, logprobs = choose_tokens(logits, rows, sampling, allowed)
            eos_ids = frozenset(self.eos_token_ids)
            for i, row in enumerate(rows):
                if not row.done:
                    row.append(chosen[i], logprobs[i] if logprobs else None, stop_ids, eos_ids, self.tokenizer)
            if all(row.done for row in rows):
                break
            step_input = torch.tensor(
                [[self.pad_token_id if r.done else r.token_ids[-1]] for r in rows], device=self.device
            )
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions[:, -1:] + 1
        del cache
        self._stats["generated_tokens"] += sum(len(r.token_ids) for r in rows)
        self._stats["wall_s"] += time.perf_counter() - started
        by_request: dict[int, list[Sample]] = {}
        errors: dict[int, str] = {}
        for row in rows:
            by_request.setdefault(id(row.request), []).append(row.to_sample(self.tokenizer))
            if row.error is not None:
                errors.setdefault(id(row.request), row.error)
        for req in batch:
            if id(req) in errors:
                yield Completion.failed(req.id, len(req.prompt_ids), errors[id(req)])
            else:
                yield Completion(id=req.id, samples=tuple(by_request[id(req)]), prompt_tokens=len(req.prompt_ids))


def _batch_kind(request: Request) -> SamplingParams:
    """Requests with equal sampling settings share a batch; the seed is per row, so it does not split."""
    return dataclasses.replace(request.sampling, seed=None)
