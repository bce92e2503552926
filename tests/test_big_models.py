"""Big models on this CPU: a model spread over devices and offloaded to disk by accelerate, a quantized one
(bitsandbytes nf4 and 8-bit on its CPU backend, torchao int8 weight-only) and a half-precision one give what
the same model in one place gives, without a second copy of the model (`ctxmix.engine.weights`,
`ctxmix.engine.layers.LayerList`)."""

import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import ctxmix
from ctxmix.engine.fingerprint import weights_sha256
from ctxmix.errors import BadInput, ModelLoadError, UnsupportedArchitecture

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from conftest import _tiny_configs, randomise_norms, tiny_model  # noqa: E402

TEXT = "The cat sat on the mat because it was tired."
CONTEXT = "The code for the staff entrance is 4817. The weather was mild. Birds sang in the trees all morning."


def _device_map(model, disk_every: int = 2) -> dict:
    """Every layer on its own entry, every other one on 'disk', the rest of the model on the CPU."""
    hf = model.hf
    base = hf.base_model_prefix
    layers = f"{base}.{model.spec.layers}"
    dm = {f"{layers}.{i}": ("disk" if i % disk_every else "cpu") for i in range(model.n_layers)}
    for n, _ in hf.named_children():
        if n != base:
            dm[n] = "cpu"
    for n, _ in getattr(hf, base).named_children():
        if f"{base}.{n}" != layers and not layers.startswith(f"{base}.{n}."):
            dm[f"{base}.{n}"] = "cpu"
    return dm


def _dispatched(family, tokenizer, tmp_path):
    """The tiny float32 model of `family` twice: in one place, and dispatched over cpu + disk (built in memory,
    then `accelerate.dispatch_model`), each a model of its own."""
    from accelerate import dispatch_model

    ref = tiny_model(family, tokenizer, dtype=torch.float32)
    other = tiny_model(family, tokenizer, dtype=torch.float32)
    hf = dispatch_model(other.hf, device_map=_device_map(other), offload_dir=str(tmp_path / "offload"))
    assert any(p.device.type == "meta" for p in hf.parameters()), "nothing was offloaded: the test would be idle"
    return ref, ctxmix.model_from_hf(hf, tokenizer, name=ref.name)


def _close(a, b, what, tol=1e-5):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape and (np.isnan(a) == np.isnan(b)).all(), what  # rows not computed are NaN in both
    a, b = np.nan_to_num(a), np.nan_to_num(b)
    assert np.abs(a - b).max(initial=0.0) <= tol * max(1.0, np.abs(a).max(initial=0.0)), what


def _methods(model) -> list[str]:
    from ctxmix.engine.scopes import scope_names
    from ctxmix.methods.registry import MIXING_METHODS, PREDICTION_METHODS, SALIENCY_METHODS

    scopes = {m for m, info in MIXING_METHODS.items() if info.group == "scope"}
    mixing = [m for m in MIXING_METHODS if m not in scopes or m in scope_names(model.spec.position)]
    return mixing + list(SALIENCY_METHODS) + list(PREDICTION_METHODS)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_dispatched_model_equals_the_model_in_one_place(tokenizer, family, tmp_path):
    """Llama, Gemma 2 (sandwich norms, soft-cap) and GPT-2 (Conv1D, fused QKV), with every other layer on disk:
    every mixing, saliency and prediction method, scope_maps and routes equal the undispatched model's, and
    the weights hash is the same (offloaded leaves loaded one at a time). On the old code the offloaded
    weights reached the engine on `meta` and every call raised."""
    ref, disp = _dispatched(family, tokenizer, tmp_path)
    assert not disp.layers.resident and ref.layers.resident
    methods = _methods(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = ctxmix.explain(ref, TEXT, methods), ctxmix.explain(disp, TEXT, methods)
    for m in methods:
        for field in ("layer_maps", "global_maps", "saliency", "logit_contributions"):
            x, y = getattr(a, field, {}).get(m), getattr(b, field, {}).get(m)
            assert (x is None) == (y is None), (m, field)
            if x is not None:
                _close(x, y, f"{family} {m} {field}")
    sa, sb = ctxmix.scope_maps(ref, TEXT), ctxmix.scope_maps(disp, TEXT)
    assert sa.keys() == sb.keys()
    for k in sa:
        _close(sa[k], sb[k], f"{family} scope {k}")
    ra, rb = ctxmix.routes(ref, TEXT), ctxmix.routes(disp, TEXT)
    _close(ra.edges["weight"].to_numpy(), rb.edges["weight"].to_numpy(), f"{family} routes")
    assert weights_sha256(ref) == weights_sha256(disp)
    assert (
        ctxmix.methods.explanation.provenance(ref)["weights_sha256"]
        == (ctxmix.methods.explanation.provenance(disp)["weights_sha256"])
    )


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_dispatched_model_attributes_context_as_in_one_place(tokenizer, tmp_path, family):
    """attribute_context's one-pass methods, at2_exact and ContextCite on the same response: equal scores."""
    ref, disp = _dispatched(family, tokenizer, tmp_path)
    methods = ["logit", "alti_logit", "attention", "grad_x_input", "at2_exact", "contextcite"]
    kw = dict(response=" the code is 4817", methods=methods, n_ablations=8, at2_weights="untrained", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = ctxmix.attribute_context(ref, CONTEXT, "What is the code?", **kw)
        b = ctxmix.attribute_context(disp, CONTEXT, "What is the code?", **kw)
    for m in methods:
        _close(a.scores[m], b.scores[m], f"context {m}", tol=1e-4 if m == "contextcite" else 1e-5)


def test_load_model_with_a_device_map_and_an_offload_folder(tokenizer, tmp_path):
    """`load_model(folder, device_map=..., offload_folder=...)`: the same maps and hash as the folder loaded
    whole (the hash of a folder is its files' hash)."""
    ref = tiny_model("llama", tokenizer, dtype=torch.float32)
    folder = tmp_path / "tiny-llama"
    ref.hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    whole = ctxmix.load_model(str(folder), device="cpu")
    spread = ctxmix.load_model(
        str(folder), device_map=_device_map(whole), offload_folder=str(tmp_path / "off"), dtype="float32"
    )
    assert any(p.device.type == "meta" for p in spread.hf.parameters())
    a, b = ctxmix.explain(whole, TEXT, ["alti", "logit"]), ctxmix.explain(spread, TEXT, ["alti", "logit"])
    _close(a.layer_maps["alti"], b.layer_maps["alti"], "alti")
    _close(a.saliency["logit"], b.saliency["logit"], "logit")
    assert weights_sha256(whole) == weights_sha256(spread)


def test_load_model_refuses_bad_placement_before_loading():
    with pytest.raises(BadInput, match="offload_folder needs a device_map"):
        ctxmix.load_model("minilm", offload_folder="/tmp/x")
    with pytest.raises(BadInput, match="quantization must be one of"):
        ctxmix.load_model("minilm", quantization="3bit")
    with pytest.raises(BadInput, match="max_memory must be a dict"):
        ctxmix.load_model("minilm", max_memory="20GiB")


# ---------------------------------------------------------------- quantized


def _llama64(tokenizer):
    """The tiny float32 Llama with d 64 and d' 128 (k, v: 32 rows): on CPUs with AVX-512 BF16, bitsandbytes'
    4-bit kernel repacks each weight in blocks of 32 output rows on its first forward
    (`_convert_weight_packed_for_cpu`, which refuses other widths), so the quantized tests use widths it takes on
    every CPU."""
    import copy

    torch.manual_seed(0)
    cls, cfg = _tiny_configs()["llama"]
    cfg = copy.deepcopy(cfg)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = D64, DFF128, D64 // cfg.num_attention_heads
    hf = cls._from_config(cfg).to(torch.float32).eval()
    randomise_norms(hf)
    return ctxmix.model_from_hf(hf, tokenizer, name="tiny-llama-32")


D64, DFF128 = 64, 128  # k and v: 2 KV heads of 16 = 32 rows


def _saved_llama(tokenizer, tmp_path):
    ref = _llama64(tokenizer)
    folder = tmp_path / "tiny-llama"
    ref.hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _twin_with_dequantized_weights(qm, tokenizer):
    """The float32 tiny Llama carrying, in every quantized linear, the matrix that linear's kernel multiplies
    by, read straight from the scheme's own state (not through ctxmix's `linear_matrix`): nf4 through
    bitsandbytes' dequantize_4bit, 8-bit as CB * SCB / 127, torchao through the tensor's dequantize()."""
    import bitsandbytes.functional as bf

    twin = _llama64(tokenizer)
    sd = {}
    for name, mod in qm.hf.named_modules():
        w = getattr(mod, "weight", None)
        kind = type(w).__name__
        if kind == "Params4bit":
            sd[name + ".weight"] = bf.dequantize_4bit(w.data, w.quant_state).float()
        elif kind == "Int8Params":
            sd[name + ".weight"] = w.data.float() * w.SCB.float()[:, None] / 127
        elif w is not None and type(w) not in (torch.Tensor, nn.Parameter):
            sd[name + ".weight"] = w.dequantize().float()
    assert len(sd) == 7 * 2, sorted(sd)  # q, k, v, o, gate, up, down of both layers
    twin.hf.load_state_dict(sd, strict=False)
    return twin


@pytest.mark.parametrize("quantization", ["4bit", "int8"])
def test_weight_only_quantized_model_equals_its_dequantized_twin(tokenizer, tmp_path, quantization):
    """bitsandbytes nf4 and torchao int8 weight-only: maps and logit contributions equal those of a float model
    carrying the matrices the kernels multiply by (1e-4), and the decomposition rebuilds the quantized model's
    own hidden states within the float32 bound (2 layers of d + d' roundings, 2^-24 each, on states of the
    size measured). On the old code the packed 4-bit weight gave head_dim 0 and explain raised."""
    qm = ctxmix.load_model(_saved_llama(tokenizer, tmp_path), quantization=quantization)
    assert qm.quantization_schemes and not qm.layers.resident
    for mod in qm.hf.modules():  # the generic 4-bit kernel on every CPU (the AVX-512 BF16 one computes in bf16:
        if hasattr(
            mod, "support_avx512bf16_for_cpu"
        ):  # test_bnb_cpu_packed_4bit_weight_is_read_as_the_kernel_reads_it)
            mod.support_avx512bf16_for_cpu = False
    twin = _twin_with_dequantized_weights(qm, tokenizer)
    methods = ["attention", "alti", "norm_res_ln", "value_zeroing", "logit", "alti_logit"]
    a, b = ctxmix.explain(qm, TEXT, methods), ctxmix.explain(twin, TEXT, methods)
    for m in methods:
        if m in a.layer_maps:
            _close(a.layer_maps[m], b.layer_maps[m], m, tol=1e-4)
        _close(a.saliency[m], b.saliency[m], m, tol=1e-4)
    for m in ("logit", "alti_logit"):
        _close(a.logit_contributions[m], b.logit_contributions[m], m, tol=1e-4)
    tr = ctxmix.trace(qm, TEXT)
    scale = max(float(h.abs().max()) for h in tr.hidden)
    d, dff = D64, DFF128
    bound = 2 * (d + dff) * 2.0**-24 * scale * 8  # 8: the roundings of the norm, softmax and products per sum
    assert tr.reconstruction_error <= bound, (tr.reconstruction_error, bound)
    assert not any("exact only up to" in w for w in a.warnings)


def test_bnb_cpu_packed_4bit_weight_is_read_as_the_kernel_reads_it():
    """On CPUs with AVX-512 BF16, a bitsandbytes 4-bit linear repacks its weight in place on its first forward
    (nibbles regrouped in blocks of 32 rows, absmax transposed and rounded to bfloat16); `dequantize_4bit` on the
    packed data reads garbage (1.28 off here). ctxmix reads the matrix the kernel multiplies by: the unpacked
    one, equal to the weight before packing up to the bf16 rounding of the absmax (2^-8 of each block's scale),
    and the model's own weight state untouched by the read."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    from ctxmix.engine.weights import linear_matrix

    torch.manual_seed(0)
    lin = bnb.nn.Linear4bit(64, 96, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    lin.weight = bnb.nn.Params4bit(torch.randn(96, 64) * 0.1, requires_grad=False, quant_type="nf4").to("cpu")
    lin = lin.eval()
    before = bf.dequantize_4bit(lin.weight.data, lin.weight.quant_state).float().clone()
    if not getattr(lin, "support_avx512bf16_for_cpu", False):
        pytest.skip("this CPU has no AVX-512 BF16: bitsandbytes does not repack 4-bit weights here")
    with torch.no_grad():
        lin(torch.randn(2, 64))
    state = lin.weight.quant_state
    assert state.packing_format_for_cpu  # the kernel repacked the weight
    absmax = state.absmax.clone()
    got = linear_matrix(lin).float()
    scale = before.abs().reshape(96, -1, state.blocksize).amax(-1, keepdim=True).expand(-1, -1, state.blocksize)
    assert float(((got - before).abs() - 2.0**-8 * scale.reshape(96, 64)).max()) <= 0
    assert state.packing_format_for_cpu and torch.equal(state.absmax, absmax)  # the model's state is untouched


def test_8bit_model_warns_with_its_measured_reconstruction_error(tokenizer, tmp_path):
    """bitsandbytes LLM.int8 also quantizes each linear's input (int8 per row, outlier columns in float16): the
    explanation says so and gives the measured reconstruction error; that error stays within the rounding of
    the inputs (half a step of a 127-level row scale per input element, through two layers' d + d'
    products) and is far above the weight-only schemes' float32 error."""
    qm = ctxmix.load_model(_saved_llama(tokenizer, tmp_path), quantization="8bit")
    assert qm.quantization_schemes == {"bnb-8bit": 14}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex = ctxmix.explain(qm, TEXT, ["alti", "logit"])
    note = [w for w in ex.warnings if "LLM.int8" in w]
    assert len(note) == 1 and f"{ex.reconstruction_error:.3g}" in note[0]
    tr = ctxmix.trace(qm, TEXT)
    scale = max(float(h.abs().max()) for h in tr.hidden)
    assert 1e-4 * scale < tr.reconstruction_error <= 2 * (24 + 40) * scale / 254 * 2, tr.reconstruction_error


class FakeQuantLinear(nn.Module):
    """A quantized linear ctxmix does not know: packed integers and no dequantize."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.register_buffer("qweight", torch.zeros(d_out, d_in // 2, dtype=torch.uint8))
        self.in_features, self.out_features = d_in, d_out

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)


def test_an_unknown_quantized_layer_is_refused_by_name(tokenizer):
    m = tiny_model("llama", tokenizer, dtype=torch.float32)
    attn = m.hf.model.layers[0].self_attn
    attn.v_proj = FakeQuantLinear(attn.v_proj.in_features, attn.v_proj.out_features)
    with pytest.raises(UnsupportedArchitecture, match="FakeQuantLinear"):
        ctxmix.model_from_hf(m.hf, tokenizer)


# ---------------------------------------------------------------- half precision


def test_half_precision_copies_one_layer_at_a_time(tokenizer, monkeypatch):
    """A bf16 model keeps no float32 copy of the model: every layer read is tracked, and at each read at most
    one earlier layer's float32 tensors are still alive (the one being replaced: the old `Model.layers` upcast
    every layer for the model's life, and a loop's enumerate tuple kept a second one alive)."""
    import gc
    import weakref

    from ctxmix.engine import layers as M

    m = tiny_model("llama", tokenizer, dtype=torch.bfloat16)
    assert m.work_dtype == torch.float32 and not m.layers.resident
    built, alive_at_read = [], []
    read = M.read_layer

    def tracked(*args, **kwargs):
        gc.collect()
        alive_at_read.append(sum(1 for r in built if r() is not None and r().W2 is not None))
        lw = read(*args, **kwargs)
        built.append(weakref.ref(lw))
        return lw

    monkeypatch.setattr(M, "read_layer", tracked)
    ctxmix.explain(m, TEXT, ["alti", "logit"])
    assert len(built) >= 2 * m.n_layers and max(alive_at_read) == 0, alive_at_read
    lw = m.layers[1]
    assert lw.W2.dtype == torch.float32 and m.layers[1] is lw  # the one slot serves repeated reads
    m.layers[0]
    assert lw.W2 is None  # read another layer: the previous one's copies are gone, loudly


def test_threads_sharing_a_model_read_their_own_layers(tokenizer):
    """The dashboard shares one model between sessions: two threads explaining on a bf16 model at once each
    get their own layer (the slot is per thread) and the results equal one thread's."""
    from concurrent.futures import ThreadPoolExecutor

    m = tiny_model("llama", tokenizer, dtype=torch.bfloat16)
    ref = ctxmix.explain(m, TEXT, ["alti", "logit"])
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: ctxmix.explain(m, TEXT, ["alti", "logit"]), range(8)))
    for ex in got:
        _close(ref.layer_maps["alti"], ex.layer_maps["alti"], "threads alti", tol=0)
        _close(ref.saliency["logit"], ex.saliency["logit"], "threads logit", tol=0)


def test_a_bad_placement_never_rebuilds_the_embedded_cache(monkeypatch, tmp_path):
    """A device_map typo is refused before anything is read, and a placement that fails to load raises
    without wiping the cached model folder."""
    from ctxmix.engine import models as M

    with pytest.raises(BadInput, match="device_map must be one of"):
        ctxmix.load_model("smollm2", device_map="autoo")
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "ctxmix_meta.json").write_text("{}")
    monkeypatch.setattr(M, "verify_weights", lambda folder, meta: None)

    def fails(*a, **k):
        raise ModelLoadError("the placement failed")

    monkeypatch.setattr(M, "_from_folder_or_hub", fails)
    with pytest.raises(ModelLoadError, match="placement failed"):
        M._cached_build(
            folder, lambda f: pytest.fail("rebuilt"), "smollm2", "cpu", torch.float32, {"device_map": "cpu"}
        )
    assert (folder / "ctxmix_meta.json").exists()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_streamed_traces_on_a_model_read_one_layer_at_a_time(tokenizer, family, tmp_path, monkeypatch):
    """A streamed trace rebuilds layers on demand while the methods walk the layers: on a dispatched model
    (one layer's copies at a time) the maps, scopes and routes still equal the model in one place, and a bf16
    model streamed equals the same model not streamed."""
    from ctxmix.engine import trace as trace_mod

    ref, disp = _dispatched(family, tokenizer, tmp_path)
    half = tiny_model(family, tokenizer, dtype=torch.bfloat16)
    methods = ["attention", "norm_res_ln", "alti", "value_zeroing", "logit", "alti_logit"]
    a, h = ctxmix.explain(ref, TEXT, methods), ctxmix.explain(half, TEXT, methods)
    sa, ra = ctxmix.scope_maps(ref, TEXT), ctxmix.routes(ref, TEXT)
    monkeypatch.setattr(trace_mod, "streams", lambda model, n: True)
    b, h2 = ctxmix.explain(disp, TEXT, methods), ctxmix.explain(half, TEXT, methods)
    for m in methods:
        _close(a.saliency[m], b.saliency[m], f"streamed {m}")
        _close(h.saliency[m], h2.saliency[m], f"bf16 streamed {m}", tol=1e-6)
    for k, v in ctxmix.scope_maps(disp, TEXT).items():
        _close(sa[k], v, f"streamed scope {k}")
    _close(ra.edges["weight"].to_numpy(), ctxmix.routes(disp, TEXT).edges["weight"].to_numpy(), "streamed routes")


# ---------------------------------------------------------------- the command line and the dashboard


def test_cli_loads_a_model_spread_over_cpu_and_disk(tokenizer, tmp_path, capsys):
    """`ctxmix explain --device-map JSON --offload-folder DIR` gives the saved explanation the folder loaded
    whole gives; a bad JSON map is one message and exit 2, before any load."""
    import json

    from ctxmix.cli import main

    folder = _saved_llama(tokenizer, tmp_path)
    whole = ctxmix.load_model(folder, device="cpu")
    dm = json.dumps(_device_map(whole))
    a, b = tmp_path / "whole.npz", tmp_path / "spread.npz"
    assert main(["explain", TEXT, "--model", folder, "--method", "alti", "--out", str(a)]) == 0
    args = ["--device-map", dm, "--offload-folder", str(tmp_path / "off")]
    assert main(["explain", TEXT, "--model", folder, "--method", "alti", "--out", str(b), *args]) == 0
    ea, eb = ctxmix.load_explanation(a), ctxmix.load_explanation(b)
    _close(ea.layer_maps["alti"], eb.layer_maps["alti"], "cli alti")
    assert main(["explain", TEXT, "--model", folder, "--device-map", "{not json"]) == 2
    assert "--device-map is not valid JSON" in capsys.readouterr().err


def test_dashboard_loads_in_bfloat16_from_the_sidebar(monkeypatch):
    """The sidebar's big-model options reach load_model (the badge says bfloat16) and travel in the link; a
    hosted copy does not offer them."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(root)
    at = AppTest.from_file(str(root / "app.py"), default_timeout=600)
    at.query_params["dtype"] = "bfloat16"
    at.query_params["method"] = ["alti"]
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="model_dtype").value == "bfloat16"
    assert any("bfloat16" in c.value for c in at.sidebar.caption), [c.value for c in at.sidebar.caption]


def test_two_torchao_configs_are_two_models_for_the_cache(tokenizer, tmp_path):
    """Two TorchAoConfigs of one class on one folder (int8 per channel, int8 per group of 8) quantize differently,
    so the results cache must key them apart: the model's info holds the whole config, not its class name (the
    same key served one's maps for the other, whose ALTI maps differ by 2.4e-3)."""
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    from ctxmix.service.cache import model_fingerprint

    folder = _saved_llama(tokenizer, tmp_path)
    row = ctxmix.load_model(folder, quantization=TorchAoConfig(Int8WeightOnlyConfig()))
    group = ctxmix.load_model(folder, quantization=TorchAoConfig(Int8WeightOnlyConfig(granularity=PerGroup(8))))
    assert row.info["quantization"]["class"] == "TorchAoConfig"
    assert model_fingerprint(row) != model_fingerprint(group)
    again = ctxmix.load_model(folder, quantization=TorchAoConfig(Int8WeightOnlyConfig()))
    assert model_fingerprint(again) == model_fingerprint(row)  # the same config: the same key, across loads
    a, b = (ctxmix.explain(m, TEXT, ["alti"]).layer_maps["alti"] for m in (row, group))
    assert np.abs(a - b).max() > 1e-5  # they are two models
    assert ctxmix.load_model(folder, quantization="int8").info["quantization"] == "int8"


def test_an_offload_hook_inside_a_sequential_hook_is_found_and_read():
    """accelerate chains hooks in a `SequentialHook` when another is added after its own (`append=True`, as other
    libraries do): the layer is still offloaded (its weights on `meta` between calls), and ctxmix reads its real
    weights (it took such a layer for resident before, and read `meta` tensors)."""
    from accelerate.hooks import AlignDevicesHook, ModelHook, SequentialHook, add_hook_to_module

    from ctxmix.engine.weights import linear_matrix, materialized, offloaded

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    want = lin.weight.detach().clone()
    weights = {"weight": lin.weight.detach().clone(), "bias": lin.bias.detach().clone()}
    add_hook_to_module(lin, AlignDevicesHook(execution_device="cpu", offload=True, weights_map=weights))
    add_hook_to_module(lin, ModelHook(), append=True)
    assert isinstance(lin._hf_hook, SequentialHook) and lin.weight.device.type == "meta"
    assert offloaded(lin)
    with materialized(lin):
        got = linear_matrix(lin).clone()
    assert torch.equal(got, want)  # (out, in), as the Linear holds it
    assert lin.weight.device.type == "meta"  # sent back after the read
