"""The native models of every supported family, loaded by our loader and run through the CPU paged-attention
path, give the same logits and greedy generations as transformers on real (tiny, random) model directories:
prompts longer than the sliding windows, MoE routing, soft-capping and partial rotary included."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchjob.engine.native.layers.attention import TorchPagedAttention, make_metadata
from batchjob.engine.native.layers.rope import rope_inv_freq
from batchjob.engine.native.loading.model_loader import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    device_dtype,
    load_model,
    read_model_spec,
)
from batchjob.job.tiny_model import ARCHITECTURES, make_tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request, tmp_path_factory):
    """(arch, model dir, our model, HF model) for each tiny architecture."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / request.param, arch=request.param)
    ours, spec = load_model(model_dir, "float32", "cpu", TorchPagedAttention())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, ours, hf


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "llama", arch="llama")


class PagedSequences:
    """Drives our model the way the engine does: flat steps over several sequences, K/V in a cache of
    shuffled (non-contiguous) blocks whose unused slots hold NaN, as uninitialised memory may."""

    def __init__(self, model, block_size: int = 4, num_blocks: int = 64, seed: int = 0) -> None:
        spec = model.spec
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.model, self.block_size = model, block_size
        self.kv_caches = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(spec.num_layers)
        ]
        self.free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append each sequence's chunk of token ids; returns each chunk's logits [len(chunk), vocab]."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq, chunk in chunks.items():
            start = self.lengths.get(seq, 0)
            self.lengths[seq] = start + len(chunk)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < self.lengths[seq]:
                table.append(self.free_blocks.pop())
            ids += chunk
            positions += range(start, self.lengths[seq])
            query_lens.append(len(chunk))
            seq_lens.append(self.lengths[seq])
            tables.append(table)
        meta = make_metadata(query_lens, seq_lens, tables, self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv_caches)
        logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split(query_lens), strict=True))


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def test_packed_prefill_of_several_sequences_matches_transformers(tiny):
    _, _, ours, hf = tiny
    prompts = random_prompts([5, 12, 1, 9], ours.spec.vocab_size)

    logits = PagedSequences(ours).step(dict(enumerate(prompts)))

    for seq, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[seq], hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_from_scattered_blocks_matches_transformers(tiny):
    _, _, ours, hf = tiny
    first, second = random_prompts([14, 10], ours.spec.vocab_size, seed=1)
    # chunk boundaries per step; both sequences advance in the same steps, with different chunkings
    schedule = [((0, 5), (0, 2)), ((5, 8), (2, 9)), ((8, 9), (9, 10)), ((9, 10), None), ((10, 14), None)]
    runner = PagedSequences(ours, block_size=4)
    got = {0: [], 1: []}

    for span_first, span_second in schedule:
        chunks = {0: first[slice(*span_first)]}
        if span_second is not None:
            chunks[1] = second[slice(*span_second)]
        for seq, seq_logits in runner.step(chunks).items():
            got[seq].append(seq_logits)

    torch.testing.assert_close(torch.cat(got[0]), hf_logits(hf, first), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got[1]), hf_logits(hf, second), atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers_generate(tiny):
    _, _, ours, hf = tiny
    prompts = random_prompts([4, 7, 11], ours.spec.vocab_size, seed=2)
    max_new_tokens = 8
    runner = PagedSequences(ours, block_size=2, num_blocks=128)

    step_logits = runner.step(dict(enumerate(prompts)))
    generated = {seq: [] for seq in range(len(prompts))}
    for _ in range(max_new_tokens):
        for seq, logits in step_logits.items():
            generated[seq].append(int(logits[-1].argmax()))
        step_logits = runner.step({seq: tokens[-1:] for seq, tokens in generated.items()})

    for seq, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        # transformers stops at EOS; our loop ignores it, so compare up to where transformers stopped
        assert generated[seq][: len(expected)] == expected


def test_sharded_checkpoint_loads_like_a_single_file(tiny, tmp_path):
    arch, model_dir, ours, hf = tiny
    sharded_dir = tmp_path / f"{arch}-sharded"
    hf.save_pretrained(sharded_dir, max_shard_size="40KB")
    shutil.copy(model_dir / "generation_config.json", sharded_dir)
    assert (sharded_dir / "model.safetensors.index.json").is_file()

    sharded, _ = load_model(sharded_dir, "float32", "cpu", TorchPagedAttention())

    for name, param in ours.state_dict().items():
        torch.testing.assert_close(sharded.state_dict()[name], param, atol=0, rtol=0)


def test_llama3_rope_scaling_is_read_and_matches_transformers(tiny_llama_dir):
    spec = read_model_spec(tiny_llama_dir)

    assert spec.rope.rope_type == "llama3"
    assert (spec.rope.factor, spec.rope.original_max_position_embeddings) == (8.0, 256)
    assert (spec.rope.low_freq_factor, spec.rope.high_freq_factor, spec.rope.theta) == (1.0, 4.0, 500000.0)
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours, _ = rope_inv_freq(spec.rope, spec.head_dim)
    torch.testing.assert_close(ours, expected)
    unscaled, _ = rope_inv_freq(spec.rope.__class__(theta=spec.rope.theta), spec.head_dim)
    assert not torch.allclose(ours, unscaled)  # the tiny model's low frequencies really are rescaled


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e6},
        {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16, "mscale": 0.7, "mscale_all_dim": 1.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    ],
)
def test_other_rope_scalings_match_transformers(tiny_llama_dir, tmp_path, rope_parameters):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope_parameters}
    (tmp_path / "config.json").write_text(json.dumps(config))

    spec = read_model_spec(tmp_path)

    expected, expected_scale = ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](LlamaConfig.from_pretrained(tmp_path))
    ours, scale = rope_inv_freq(spec.rope, spec.head_dim)
    torch.testing.assert_close(ours, expected)
    assert scale == pytest.approx(expected_scale)


def test_old_style_rope_theta_and_rope_scaling_keys_are_read(tiny_llama_dir, tmp_path):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(config))

    rope = read_model_spec(tmp_path).rope

    assert (rope.rope_type, rope.theta, rope.factor) == ("linear", 1e6, 2.0)


def test_spec_reads_sizes_dtype_and_eos_from_config_files(tiny_llama_dir):
    spec = read_model_spec(tiny_llama_dir, max_model_len=512)

    assert spec.architecture in SUPPORTED_ARCHITECTURES
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (2, 4, 2, 16)
    assert spec.max_model_len == 512
    assert spec.dtype == torch.float32  # auto: the config's dtype
    assert spec.eos_token_ids == (2,)
    assert spec.tie_word_embeddings
    assert spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_bfloat16_load_materialises_every_parameter_in_bfloat16(tiny_llama_dir):
    model, spec = load_model(tiny_llama_dir, "bfloat16", "cpu", TorchPagedAttention())

    assert spec.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())


def test_unsupported_architecture_is_refused_naming_the_supported_ones_and_engine_hf(tiny_llama_dir, tmp_path):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as err:
        read_model_spec(tmp_path)

    assert "engine=hf" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_pickle_only_model_directory_is_refused(tiny_llama_dir, tmp_path):
    for name in ("config.json", "generation_config.json"):
        shutil.copy(tiny_llama_dir / name, tmp_path)
    torch.save({"model.norm.weight": torch.ones(64)}, tmp_path / "pytorch_model.bin")

    with pytest.raises(UnsupportedModelError, match="pickle"):
        read_model_spec(tmp_path)
    with pytest.raises(UnsupportedModelError, match="safetensors"):
        load_model(tmp_path, "auto", "cpu", TorchPagedAttention())


def test_missing_local_directory_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_model_spec(tmp_path / "no-such-model")


def test_dtype_auto_runs_a_float32_checkpoint_in_bfloat16_on_a_gpu_only(tiny_llama_dir):
    spec = read_model_spec(tiny_llama_dir)  # the tiny model declares float32
    assert spec.dtype == torch.float32
    assert device_dtype(spec, "auto", "cuda").dtype == torch.bfloat16
    assert device_dtype(spec, "auto", "cuda:1").dtype == torch.bfloat16
    assert device_dtype(spec, "auto", "cpu") is spec
    assert device_dtype(spec, "float32", "cuda") is spec
    half = read_model_spec(tiny_llama_dir, "float16")
    assert device_dtype(half, "auto", "cuda") is half


def test_a_hub_model_is_fetched_with_every_file_its_tokenizer_may_be_saved_as(tmp_path, monkeypatch):
    import fnmatch

    import huggingface_hub

    from batchjob.engine.native.loading.model_loader import resolve_model_dir

    asked = {}

    def snapshot_download(repo_id, allow_patterns):
        asked[repo_id] = allow_patterns
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model_dir("org/model", with_weights=False) == tmp_path
    needed = [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
        "spiece.model", "sentencepiece.bpe.model", "qwen.tiktoken",
    ]  # fmt: skip
    assert [f for f in needed if not any(fnmatch.fnmatch(f, p) for p in asked["org/model"])] == []
    assert not any(fnmatch.fnmatch("model-00001-of-00004.safetensors", p) for p in asked["org/model"])
    resolve_model_dir("org/model", with_weights=True)
    assert any(fnmatch.fnmatch("model-00001-of-00004.safetensors", p) for p in asked["org/model"])


def test_damaged_weight_files_are_refused_from_their_headers(tiny, tmp_path):
    from batchjob.engine.weight_files import BrokenWeightsError

    arch, model_dir, _, hf = tiny
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    read_model_spec(sharded)  # intact

    grown = shards[0].read_bytes()
    shards[0].write_bytes(grown + b"\0" * 8)
    with pytest.raises(BrokenWeightsError, match="bytes beyond its last tensor"):
        read_model_spec(sharded)
    shards[0].write_bytes(b"\x40" + b"\0" * 7 + b"{not json" + b" " * 55)
    with pytest.raises(BrokenWeightsError, match="is not a readable safetensors file"):
        read_model_spec(sharded)
    shards[0].write_bytes(grown)
    shards[1].unlink()
    with pytest.raises(
        BrokenWeightsError, match=f"1 of the {len(shards)} weight files .* are missing .*{shards[1].name}"
    ):
        read_model_spec(sharded)
    for shard in shards:
        shard.unlink(missing_ok=True)
    read_model_spec(sharded)  # configs and the index only: the weights come later (a hub fetch, or dummy weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_written_into_a_buffer_equal_the_returned_ones_soft_capped_too(tmp_path, dtype):
    # A step with constrained rows leaves its logits in the runner's float32 buffer for its masked sampler.
    model_dir = make_tiny_model(tmp_path / "gemma2", arch="gemma2")  # final logit soft-capping
    ours, spec = load_model(
        model_dir, "float32" if dtype == torch.float32 else "bfloat16", "cpu", TorchPagedAttention()
    )
    assert spec.final_softcap > 0
    hidden = torch.randn(5, spec.hidden_size, dtype=dtype) * 3
    out = torch.full((5, spec.vocab_size), float("nan"), dtype=torch.float32)
    with torch.no_grad():
        returned = ours.compute_logits(hidden)
        written = ours.compute_logits(hidden, out=out)
    assert written.data_ptr() == out.data_ptr() and returned.dtype == torch.float32
    assert torch.equal(written, returned)


@pytest.mark.parametrize(
    ("arch", "split"), [("llama", True), ("qwen2", True), ("olmo2", False), ("gemma2", False), ("mixtral", False)]
)
def test_only_projections_feeding_a_fused_add_and_norm_may_split_k(arch, split, tmp_path):
    # Split-K partial sums are added up by the residual add + RMSNorm that follows: norms before the sublayers
    # (not OLMo 2's after, nor Gemma's around), no bias on the projection (Qwen2's is on q/k/v only), and a
    # dense MLP (a mixture of experts sums its own output).
    model_dir = make_tiny_model(tmp_path / arch, arch=arch)
    ours, spec = load_model(model_dir, "bfloat16", "cpu", TorchPagedAttention())
    layer = ours.layers[0]
    attention = spec.norm_placement == "pre" and not spec.o_bias
    assert layer.self_attn.fused_add == attention
    assert getattr(layer.mlp, "fused_add", False) == split
    # Greedy logits may stay in the model's dtype, except soft-capped ones.
    hidden = torch.randn(3, spec.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        raw = ours.compute_logits(hidden, float32=False)
    assert raw.dtype == (torch.float32 if spec.final_softcap > 0 else torch.bfloat16)


@pytest.mark.parametrize(("arch", "per_layer"), [("llama", 2), ("mixtral", 1)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_half_precision_projections_add_their_product_into_the_residual_in_the_matmul(
    dtype, arch, per_layer, tmp_path, monkeypatch
):
    # A bf16 o_proj / down_proj feeding the fused add + norm writes residual + product in one matmul, and the
    # norm reads only the sum: the same logits up to one rounding fewer. float32 models keep transformers'
    # order (the product rounded, then added), so they take the plain path. A mixture of experts adds its own
    # output: only its o_proj does.
    from batchjob.engine.native.layers import split_k
    from batchjob.engine.native.runtime.kv_cache import allocate_kv_cache

    model_dir = make_tiny_model(tmp_path / arch, arch=arch)
    ours, spec = load_model(model_dir, dtype, "cpu", TorchPagedAttention())
    n = 24
    prompt = torch.tensor(random_prompts([n], spec.vocab_size)[0])
    added = []
    fused = split_k.adds_into_residual

    def logits(fuse: bool) -> torch.Tensor:
        monkeypatch.setattr(split_k, "adds_into_residual", lambda w: added.append(fuse) or (fuse and fused(w)))
        caches = allocate_kv_cache(spec, 8, 4, torch.device("cpu"))
        meta = make_metadata([n], [n], [list(range(1, 7))], 4)
        with torch.no_grad():
            return ours.compute_logits(ours(prompt, torch.arange(n), meta, caches)).double()

    into_residual, plain = logits(True), logits(False)
    assert added.count(True) == added.count(False) == per_layer * spec.num_layers
    if dtype == "float32":
        assert torch.equal(into_residual, plain)
        return
    assert not torch.equal(into_residual, plain)
    assert ((into_residual - plain).norm() / plain.norm()).item() < 1e-2
    assert (into_residual.argmax(-1) == plain.argmax(-1)).float().mean().item() > 0.9
