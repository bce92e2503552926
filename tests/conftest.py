"""Tiny random models of the real Hugging Face classes, one per supported family."""

import os

import pytest
import torch
import transformers as T

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import ctxmix  # noqa: E402

V = 30522  # the MiniLM tokenizer's vocabulary, shared by every tiny model


def _tiny_configs():
    common = dict(vocab_size=V, initializer_range=0.2)  # large enough that tokens, not biases, dominate
    return {
        "bert": (
            T.BertForSequenceClassification,
            T.BertConfig(hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40, **common),
        ),
        "roberta": (
            T.RobertaForMaskedLM,
            T.RobertaConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=40,
                max_position_embeddings=130,
                pad_token_id=1,
                **common,
            ),
        ),
        "electra": (
            T.ElectraForSequenceClassification,
            T.ElectraConfig(
                embedding_size=16,
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=40,
                **common,
            ),
        ),
        "distilbert": (
            T.DistilBertForSequenceClassification,
            T.DistilBertConfig(dim=24, n_layers=2, n_heads=4, hidden_dim=40, **common),
        ),
        "gpt2": (
            T.GPT2LMHeadModel,
            T.GPT2Config(n_embd=24, n_layer=2, n_head=4, n_positions=128, bos_token_id=101, eos_token_id=102, **common),
        ),
        "opt": (
            T.OPTForCausalLM,
            T.OPTConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                ffn_dim=40,
                word_embed_proj_dim=24,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "llama": (
            T.LlamaForCausalLM,
            T.LlamaConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=40,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "llama3": (
            T.LlamaForCausalLM,
            T.LlamaConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                intermediate_size=40,
                max_position_embeddings=128,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                rope_theta=500000.0,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "mistral": (
            T.MistralForCausalLM,
            T.MistralConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=40,
                max_position_embeddings=128,
                sliding_window=4,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "qwen2": (
            T.Qwen2ForCausalLM,
            T.Qwen2Config(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=40,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "qwen3": (
            T.Qwen3ForCausalLM,
            T.Qwen3Config(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                intermediate_size=40,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "phi3": (
            T.Phi3ForCausalLM,
            T.Phi3Config(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=40,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "gpt_neox": (
            T.GPTNeoXForCausalLM,
            T.GPTNeoXConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=40,
                max_position_embeddings=128,
                rotary_pct=0.5,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "phi": (
            T.PhiForCausalLM,
            T.PhiConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=40,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "gemma": (
            T.GemmaForCausalLM,
            T.GemmaConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=6,
                intermediate_size=40,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "gemma2": (
            T.Gemma2ForCausalLM,
            T.Gemma2Config(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=6,
                intermediate_size=40,
                max_position_embeddings=128,
                sliding_window=4,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "gemma3": (
            T.Gemma3ForCausalLM,
            T.Gemma3TextConfig(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=6,
                intermediate_size=40,
                max_position_embeddings=128,
                sliding_window=4,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                **common,
            ),
        ),
        "deberta": (
            T.DebertaV2ForSequenceClassification,
            T.DebertaV2Config(
                hidden_size=24,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=40,
                max_position_embeddings=128,
                relative_attention=True,
                position_buckets=16,
                pos_att_type=["p2c", "c2p"],
                pad_token_id=0,
                **common,
            ),
        ),
        "modernbert": (
            T.ModernBertForMaskedLM,
            T.ModernBertConfig(
                hidden_size=24,
                num_hidden_layers=3,
                num_attention_heads=4,
                intermediate_size=40,
                max_position_embeddings=128,
                global_attn_every_n_layers=2,
                local_attention=4,
                pad_token_id=0,
                bos_token_id=101,
                eos_token_id=102,
                cls_token_id=101,
                sep_token_id=102,
                **common,
            ),
        ),
    }


FAMILIES = list(_tiny_configs())


@pytest.fixture(scope="session")
def tokenizer():
    return T.AutoTokenizer.from_pretrained(ctxmix.engine.embedded.minilm_path())


def exact_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kw):
    """Eager attention in the inputs' dtype, no float32 softmax: softmax(q k^T * scaling [soft-capped] + mask) v;
    (B, n, H, dh), probabilities. A float64 reference independent of ctxmix's own probabilities."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    probs = torch.softmax(scores, -1)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def exact_eager_twin(hf):
    """A copy of a transformers model that runs `exact_eager_attention` (its own config: the original is left
    as it is), for references that read every probability."""
    import copy

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register("exact_eager", exact_eager_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("exact_eager", eager_mask)
    twin = copy.deepcopy(hf)
    twin.set_attn_implementation("exact_eager")
    return twin


def randomise_norms(hf):
    """Random LayerNorm/RMSNorm gammas and betas, so the tests see non-trivial norms."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            low = name.lower()
            if ("norm" in low or "ln_" in low) and p.ndim == 1:
                p.copy_(
                    1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                    if name.endswith("weight")
                    else 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                )
            elif name.endswith("bias") and p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def tiny_model(family: str, tokenizer, dtype=torch.float64):
    torch.manual_seed(0)
    cls, cfg = _tiny_configs()[family]
    hf = cls._from_config(cfg).to(dtype).eval()  # the user's default attention (SDPA where the class has it)
    randomise_norms(hf)
    return ctxmix.model_from_hf(hf, tokenizer, name=f"tiny-{family}")


def tiny_variant(family: str, tokenizer, cls=None, name: str | None = None, **config_changes):
    """A tiny model of `family`'s config with some fields changed (e.g. a post-LN OPT) or another head
    class on it (e.g. a RoBERTa classifier), in float64 with the random norms of the others."""
    import copy

    torch.manual_seed(0)
    base_cls, cfg = _tiny_configs()[family]
    cfg = copy.deepcopy(cfg)
    for k, v in config_changes.items():
        setattr(cfg, k, v)
    hf = (cls or base_cls)._from_config(cfg).to(torch.float64).eval()
    randomise_norms(hf)
    return ctxmix.model_from_hf(hf, tokenizer, name=name or f"tiny-{family}-variant")


@pytest.fixture(scope="session", params=FAMILIES)
def tiny(request, tokenizer):
    return tiny_model(request.param, tokenizer)


@pytest.fixture(scope="session")
def minilm():
    return ctxmix.load_model("minilm", device="cpu")
