"""Unit tests without a model: config, KV pool layout, page allocator, sampling."""

from __future__ import annotations

import json

import pytest
import torch

from backend.engine.config import EngineConfig
from backend.engine.formats import KV_AUTO_WHY, choose_kv_format
from backend.engine.kv_pool import KVPool
from backend.engine.page_allocator import PageAllocator, PoolFullError
from backend.engine.sampling.sampler import ARGMAX_CHUNK, ARGMAX_TWO_PASS_ROWS, argmax_rows, make_generator, sample
from backend.engine.sampling_params import SamplingParams
from backend.engine.sequence import Sequence

# --- EngineConfig -----------------------------------------------------------------------------


def test_config_defaults_and_pages_from_tokens():
    config = EngineConfig(model_path="/m", kv_cache_tokens=1000, page_size=16)
    assert config.num_pages == 63 and config.dtype == "float32"
    assert config.torch_device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_config_from_string_dict():
    config = EngineConfig.from_dict(
        {
            "model_path": "/m",
            "page_size": "32",
            "num_pages": "10",
            "max_num_batched_tokens": " 128 ",
            "device": "cpu",
            "num_threads": "",
        }
    )
    assert (config.page_size, config.num_pages, config.max_num_batched_tokens, config.num_threads) == (32, 10, 128, 0)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"model_path": "/m", "page_size": "0"}, "page_size must be a positive integer"),
        ({"model_path": "/m", "page_size": "abc"}, "'page_size' must be an integer"),
        ({"model_path": "/m", "dtype": "int8"}, "dtype must be one of"),
        # a removed format (int8, int4w-a8, int4w-a8-bf16): refused, naming the formats there are
        ({"model_path": "/m", "weights_dtype": "int8"}, r"weights_dtype must be one of \['auto', 'float32', .*'fp16w'"),
        ({"model_path": "/m", "weights_dtype": "int4w-a8"}, r"one of \[.*'int4w', 'int4w-bf16'\], got 'int4w-a8'"),
        ({"model_path": "/m", "device": "tpu"}, "device must be"),
        ({"model_path": "/m", "bogus": "1"}, "unknown engine parameter"),
        ({"model_path": "/m", "kv_disk_reader": "fast"}, "kv_disk_reader must be one of auto, nixl, plain"),
        ({"model_path": ""}, "model_path is required"),
    ],
)
def test_config_rejects_bad_values(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_dict(values)


def test_kv_dtype_auto_is_float16_under_the_fused_formats_and_exact_under_float32():
    for fmt in ("int4w", "int4w-bf16", "fp16w", "fp16w-bf16"):
        assert choose_kv_format("float32", fmt, "cpu") == ("float16", KV_AUTO_WHY), fmt
    assert choose_kv_format("float32", "float32", "cpu") == ("float32", "as dtype under float32 weights (exact)")
    assert choose_kv_format("float32", "bfloat16", "cpu")[0] == "float32"  # not a fused format: no gain measured
    assert choose_kv_format("float32", "int4w", "cuda") == ("float32", "as dtype on cuda")
    assert choose_kv_format("bfloat16", "bfloat16", "cpu")[0] == "bfloat16"
    config = EngineConfig(model_path="/m", weights_dtype="int4w")
    assert (config.kv_dtype, config.kv_choice) == ("float16", KV_AUTO_WHY)
    config = EngineConfig(model_path="/m", weights_dtype="int4w", kv_dtype="float32")  # named: kept, no why
    assert (config.kv_dtype, config.kv_choice) == ("float32", "")


def test_config_max_model_len_capped_by_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 300}))
    assert EngineConfig(model_path=str(tmp_path), max_model_len=4096).resolve_max_model_len() == 300
    assert EngineConfig(model_path=str(tmp_path), max_model_len=100).resolve_max_model_len() == 100


# --- KVPool -----------------------------------------------------------------------------------


def test_kv_pool_hnd_layout_pages_are_contiguous():
    pool = KVPool(
        num_layers=3,
        num_pages=5,
        num_kv_heads=2,
        page_size=4,
        head_dim=8,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    assert pool.tensor.shape == (3, 5, 2, 2, 4, 8) and pool.tensor.is_contiguous()
    assert pool.layer(1).is_contiguous() and pool.layer(1).data_ptr() == pool.tensor.data_ptr() + pool.bytes_per_layer
    page = pool.layer(2)[3]
    assert page.is_contiguous() and pool.bytes_per_page_per_layer == 2 * 2 * 4 * 8 * 4
    # a page of a layer is where the fabric addresses it: the layer's base plus page x page bytes
    assert page.data_ptr() == pool.layer(2).data_ptr() + 3 * pool.bytes_per_page_per_layer
    assert pool.layout() == {
        "layout": "HND",
        "num_layers": 3,
        "num_pages": 5,
        "page_size": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float32",
        "bytes_per_page_per_layer": 512,
    }


# --- PageAllocator ----------------------------------------------------------------------------


def test_allocator_allocate_extend_free():
    alloc = PageAllocator(num_pages=8, page_size=4)
    pages = alloc.allocate("a", 5)
    assert len(pages) == 2 and alloc.stats()["used"] == 2
    added = alloc.extend("a", 13)
    assert len(added) == 2 and alloc.page_table("a") == pages + added
    assert alloc.extend("a", 16) == []
    assert set(alloc.page_table("a")).isdisjoint(alloc.allocate("b", 4))
    stats = {"total": 8, "free": 3, "used": 5, "requests": 2, "committed": 5, "page_size": 4, "cached": 0}
    assert {k: alloc.stats()[k] for k in stats} == stats
    assert alloc.free("a") == 4
    assert alloc.stats()["free"] == 7
    alloc.free("b")
    stats = {"total": 8, "free": 8, "used": 0, "requests": 0, "committed": 0, "page_size": 4, "cached": 0}
    assert {k: alloc.stats()[k] for k in stats} == stats


def test_allocator_hands_out_the_lowest_free_pages_so_runs_stay_adjacent():
    alloc = PageAllocator(num_pages=16, page_size=4)
    assert alloc.allocate("a", 12) == [0, 1, 2]
    assert alloc.allocate("b", 8) == [3, 4]
    assert alloc.allocate("c", 16) == [5, 6, 7, 8]
    alloc.free("a")
    alloc.free("c")
    # the freed pages come back lowest first: one run where the next request fits
    assert alloc.allocate("d", 12) == [0, 1, 2]
    assert alloc.allocate("e", 24) == [5, 6, 7, 8, 9, 10]


def test_allocator_double_free_and_unknown_are_errors():
    alloc = PageAllocator(num_pages=4, page_size=4)
    alloc.allocate("a", 4)
    alloc.free("a")
    with pytest.raises(KeyError, match="unknown or already freed"):
        alloc.free("a")
    with pytest.raises(KeyError):
        alloc.extend("nobody", 3)
    alloc.allocate("a", 1)
    with pytest.raises(ValueError, match="already holds pages"):
        alloc.allocate("a", 1)


def test_allocator_commitments_protect_running_requests():
    alloc = PageAllocator(num_pages=6, page_size=4)
    alloc.allocate("a", 4, commit_tokens=16)  # holds 1 page, may grow to 4
    stats = alloc.stats()
    assert stats["used"] == 1 and stats["total"] - stats["committed"] == 2  # 2 pages uncommitted
    with pytest.raises(PoolFullError):
        alloc.allocate("b", 12)  # 3 pages: only 2 uncommitted although 5 are free
    alloc.allocate("b", 8)
    alloc.extend("a", 16)  # within its commitment: always succeeds
    with pytest.raises(PoolFullError):
        alloc.extend("b", 9)  # beyond its commitment and the pool is fully committed
    with pytest.raises(PoolFullError):
        alloc.commit("b", 12)
    alloc.free("a")
    alloc.commit("b", 12)
    alloc.extend("b", 12)
    assert alloc.stats()["committed"] == 3


# --- SamplingParams / sampler ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [[]]}, "empty sequence"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalises_ids():
    params = SamplingParams(end_ids=7, stop_token_ids=[[1, 2], (3,)])
    assert params.end_ids == (7,) and params.stop_token_ids == ((1, 2), (3,))


def test_sampler_greedy_and_seeded():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = SamplingParams()
    assert sample(logits, [greedy] * 3, [None] * 3) == logits.argmax(-1).tolist()
    params = SamplingParams(temperature=1.5, seed=42)
    draws = [sample(logits[:1], [params], [make_generator(params, torch.device("cpu"))])[0] for _ in range(2)]
    assert draws[0] == draws[1]
    generator = make_generator(params, torch.device("cpu"))
    seq = [sample(logits[:1], [params], [generator])[0] for _ in range(30)]
    assert len(set(seq)) > 1  # a real random draw, not argmax


def test_argmax_rows_is_argmax_ties_nans_and_masked_rows_included():
    """The two-pass argmax gives argmax's index: the first of tied largest values (in one chunk and
    across chunks), the first NaN, 0 for a row all -inf; and argmax itself where the vocabulary is
    not whole chunks or the rows are few."""
    assert ARGMAX_TWO_PASS_ROWS <= 9
    torch.manual_seed(0)
    n = 96 * ARGMAX_CHUNK
    rows = torch.randn(9, n)
    rows[1, [5, 6, 3 * ARGMAX_CHUNK + 1]] = 50.0  # ties inside the first chunk and in a later one
    rows[2, [7 * ARGMAX_CHUNK + 3, 2 * ARGMAX_CHUNK + 9]] = 50.0  # tied across chunks, the later one first
    rows[3, [40 * ARGMAX_CHUNK + 2, 90 * ARGMAX_CHUNK]] = float("nan")
    rows[4] = float("-inf")
    rows[5, -1] = 50.0  # the last value
    rows[6] = rows[6].round()  # many ties
    want = rows.argmax(dim=-1)
    assert want[1] == 5 and want[2] == 2 * ARGMAX_CHUNK + 9 and want[3] == 40 * ARGMAX_CHUNK + 2 and want[4] == 0
    assert torch.equal(argmax_rows(rows), want)
    assert torch.equal(argmax_rows(rows[:1]), want[:1])
    odd = torch.randn(ARGMAX_TWO_PASS_ROWS, n + 5)
    assert torch.equal(argmax_rows(odd), odd.argmax(dim=-1))


def test_sampler_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0, -1.0, -2.0]])
    top_k = SamplingParams(temperature=1.0, top_k=2, seed=1)
    gen = make_generator(top_k, torch.device("cpu"))
    assert {sample(logits, [top_k], [gen])[0] for _ in range(200)} == {0, 1}
    top_p = SamplingParams(temperature=1.0, top_p=0.5, seed=1)  # token 0 alone has ~0.66 probability
    gen = make_generator(top_p, torch.device("cpu"))
    assert {sample(logits, [top_p], [gen])[0] for _ in range(50)} == {0}


def test_sequence_stop_conditions():
    seq = Sequence("s", [5, 6], SamplingParams(max_tokens=10, end_ids=(9,), stop_token_ids=[[3, 4]]), None)
    for token, expected in [(1, None), (3, None), (4, "stop")]:
        seq.token_ids.append(token)
        assert seq.check_stop(max_model_len=100) == expected
    seq = Sequence(
        "s", [3], SamplingParams(max_tokens=10, end_ids=(9,), ignore_eos=True, stop_token_ids=[[3, 4]]), None
    )
    seq.token_ids.append(9)
    assert seq.check_stop(100) is None  # ignore_eos; the prompt's 3 does not count toward the stop sequence
    seq.token_ids.append(4)
    assert seq.check_stop(100) is None
    seq.token_ids.append(1)
    assert seq.check_stop(max_model_len=4) == "length"


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17])
def test_small_batch_linear_computes_what_linear_computes(rows, kernels):
    from backend.engine.small_batch_linear import MAX_ROWS, SmallBatchLinear, use_small_batch_linears

    torch.manual_seed(0)
    model = torch.nn.Module()
    # 200 outputs: not a multiple of 8 (the kernel's blocks), so the last rows take its tail loop
    model.body = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 32, bias=False))
    model.lm_head = torch.nn.Linear(32, 200, bias=False)
    model.odd = torch.nn.Linear(40, 8)  # 40 inputs: not a multiple of 16, left to nn.Linear
    x = torch.randn(1, rows, 64)
    ref = model.lm_head(model.body(x))
    assert use_small_batch_linears(model) == 3
    assert all(type(m) is SmallBatchLinear for m in (*model.body, model.lm_head))
    assert type(model.odd) is torch.nn.Linear
    profile = torch.profiler.profile()
    with profile:
        out = model.lm_head(model.body(x))
    kernel_calls = sum(e.name == "group_kernel::f32_matmul" for e in profile.events())
    assert kernel_calls == (3 if rows <= MAX_ROWS else 0)  # more rows than that: the ordinary path
    assert out.shape == ref.shape == (1, rows, 200) and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):  # another dtype than the weights': the ordinary path, which refuses it
        model.body[0](x.double())
