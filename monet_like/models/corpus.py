"""The differential corpus: third-party models, tiny, randomly initialised, dropout on.

Every schedule of these is replayed against eager PyTorch (tests/test_corpus.py and
scripts/bench_corpus.py). Each entry is a model expression as `solve.py` takes it, a
per-sample input shape and a batch size small enough to train in a second here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    name: str
    expression: str
    input_shape: tuple[int, ...]
    batch: int
    what: str  # the constructs it exercises


_IMG = (3, 32, 32)
TIMM = [
    Entry(
        "vit",
        "timm.vit_tiny_patch16_224(img_size=32, patch_size=8, depth=2, num_classes=10,"
        " drop_rate=0.1, attn_drop_rate=0.1, drop_path_rate=0.1)",
        _IMG,
        4,
        "plain ViT: patch embedding, attention, dropout, drop_path",
    ),
    Entry(
        "swin",
        "timm.swin_tiny_patch4_window7_224(img_size=56, window_size=7, depths=(1, 1),"
        " num_heads=(1, 2), embed_dim=24, num_classes=10, drop_path_rate=0.1)",
        (3, 56, 56),
        2,
        "windowed attention, relative-position index buffer, shifted windows",
    ),
    Entry(
        "beit",
        "timm.beit_base_patch16_224(img_size=32, patch_size=8, depth=2, embed_dim=32,"
        " num_heads=2, num_classes=10, drop_path_rate=0.1)",
        _IMG,
        4,
        "relative-position bias table and buffer, layer scale",
    ),
    Entry(
        "deit_distilled",
        "timm.deit_tiny_distilled_patch16_224(img_size=32, patch_size=8, depth=2, num_classes=10)",
        _IMG,
        4,
        "two heads: a tuple of outputs in training",
    ),
    Entry(
        "convnext",
        "timm.convnext_atto(num_classes=10, drop_path_rate=0.1)",
        _IMG,
        4,
        "depthwise 7x7 convolutions, channels-last LayerNorm, layer scale, drop_path",
    ),
    Entry(
        "efficientnet",
        "timm.efficientnet_b0(num_classes=10, drop_path_rate=0.1)",
        _IMG,
        4,
        "in-place SiLU, squeeze-excite gates, drop_path",
    ),
    Entry(
        "mobilenetv3",
        "timm.mobilenetv3_small_100(num_classes=10)",
        _IMG,
        4,
        "in-place hardswish and ReLU, hard-sigmoid squeeze-excite",
    ),
    Entry(
        "regnet",
        "timm.regnetx_002(num_classes=10)",
        _IMG,
        4,
        "grouped convolutions, in-place ReLU after residual add",
    ),
    Entry(
        "resnet_d",
        "timm.resnet26d(num_classes=10, drop_path_rate=0.1)",
        _IMG,
        4,
        "deep stem, average-pool shortcut, in-place add",
    ),
    Entry(
        "mixer",
        "timm.models.mlp_mixer:MlpMixer(img_size=32, patch_size=8, num_blocks=2,"
        " embed_dim=64, num_classes=10, drop_path_rate=0.1)",
        _IMG,
        4,
        "token- and channel-mixing MLPs, transposes",
    ),
    Entry(
        "mobilevit",
        "timm.mobilevit_xxs(num_classes=10)",
        (3, 64, 64),
        2,
        "hybrid convolution and attention, unfold/fold of patches",
    ),
    Entry(
        "rexnet",
        "timm.rexnet_100(num_classes=10)",
        _IMG,
        4,
        "in-place add into a channel slice, SiLU, ReLU6",
    ),
    Entry(
        "ghostnet",
        "timm.ghostnet_050(num_classes=10)",
        _IMG,
        4,
        "concatenated cheap features, slicing, squeeze-excite",
    ),
]

_TOKENS = (32,)
_LM = "vocab_size=256, max_position_embeddings=64"
HF = [
    Entry(
        "gpt2",
        "transformers.gpt2(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,"
        " bos_token_id=0, eos_token_id=0)",
        _TOKENS,
        4,
        "Conv1D projections, causal mask buffer, tensor constants, dropout",
    ),
    Entry(
        "bert",
        "transformers.bert(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,"
        f" intermediate_size=128, {_LM})",
        _TOKENS,
        4,
        "token-type and position buffers, tied decoder weight, dropout",
    ),
    Entry(
        "llama_gqa",
        "transformers.llama(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,"
        f" num_key_value_heads=2, intermediate_size=128, attention_dropout=0.1, {_LM})",
        _TOKENS,
        4,
        "RoPE, RMSNorm, SwiGLU, grouped-query attention",
    ),
    Entry(
        "qwen2",
        "transformers.qwen2(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,"
        f" num_key_value_heads=1, intermediate_size=128, {_LM})",
        _TOKENS,
        4,
        "multi-query attention with biased projections, tied embeddings",
    ),
    Entry(
        "t5",
        "transformers.t5(num_layers=2, num_decoder_layers=2, d_model=64, d_kv=16, d_ff=128,"
        " num_heads=4, vocab_size=256)",
        _TOKENS,
        4,
        "encoder-decoder, relative attention buckets, cross-attention, dropout",
    ),
    Entry(
        "vit_hf",
        "transformers.vit(image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=64,"
        " num_attention_heads=4, intermediate_size=128, hidden_dropout_prob=0.1,"
        " attention_probs_dropout_prob=0.1, num_labels=10)",
        _IMG,
        4,
        "CLS token parameter, position embeddings, dropout",
    ),
]

CORPUS = TIMM + HF
BY_NAME = {e.name: e for e in CORPUS}
