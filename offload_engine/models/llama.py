"""The Llama decoder (Llama 2/3, and the base of Qwen2 and Qwen3: q/k/v biases; per-head q/k RMSNorm). Under tensor
parallelism (tp: this rank's Partition) the layers split as docs/design.md, "More than one GPU" says.
"""
import torch
from torch import nn

from offload_engine.config import ModelConfig
from offload_engine.distributed.parallel_state import Partition
from offload_engine.layers.activation import SiluAndMul
from offload_engine.layers.attention import Attention
from offload_engine.layers.attention_metadata import AttentionMetadata
from offload_engine.layers.embedding import LMHead, VocabEmbedding
from offload_engine.layers.fused import stores_kv_ahead
from offload_engine.layers.linear import FusedLinear, RowParallelLinear
from offload_engine.layers.norm import RMSNorm
from offload_engine.layers.rotary import RotaryEmbedding


class LlamaSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool, rotary: RotaryEmbedding,
                 tp: Partition):
        super().__init__()
        # This rank's heads: the checkpoint's projections split into whole heads (ModelConfig.check_tensor_parallel).
        self.num_heads, self.num_kv_heads = tp.share(cfg.num_heads), tp.share(cfg.num_kv_heads)
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=o_bias, tp=tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, scale=cfg.head_dim**-0.5)

    def project_qkv(self, positions: torch.Tensor, hidden: torch.Tensor, kv_slots: torch.Tensor | None = None):
        """hidden [T, hidden] -> q [T, Hq, D], k/v [T, Hkv, D], normalized (Qwen3) and rotated. kv_slots: the device
        slots the rotation's kernel also stores k and v at (layers.fused.stores_kv_ahead)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        store = None
        if kv_slots is not None:
            from gpu_kernels import KVStore

            store = KVStore(v, self.attn.k_cache, self.attn.v_cache, kv_slots)
        q, k = self.rotary.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm, store)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Partition):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": size, "up": size}, bias=cfg.mlp_bias, tp=tp)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: LlamaSelfAttention, tp: Partition):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pre_attention(self, positions, hidden, residual, kv_slots=None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project_qkv(positions, hidden, kv_slots), residual)

    def post_attention(self, attn_out, residual):
        hidden = self.self_attn.o_proj(attn_out.flatten(1))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool, max_position: int,
                 tp: Partition):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, LlamaSelfAttention(cfg, qkv_bias, o_bias, qk_norm, rotary, tp), tp)
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # The forward pass in segments that meet only at attention, so that graphs and layer-major prefill can put
    # attention where they need it (docs/design.md, "The split attention layer"). kv_slots: see project_qkv.
    def begin(self, token_ids, positions, kv_slots=None):
        return self.layers[0].pre_attention(positions, self.embed_tokens(token_ids), None, kv_slots)

    def between(self, layer: int, positions, attn_out, residual, kv_slots=None):
        hidden, residual = self.layers[layer - 1].post_attention(attn_out, residual)
        return self.layers[layer].pre_attention(positions, hidden, residual, kv_slots)

    def end(self, attn_out, residual):
        hidden, residual = self.layers[-1].post_attention(attn_out, residual)
        return self.norm(hidden, residual)[0]

    def attend(self, layer: int, q, k, v, meta, kv_stored: bool = False):
        return self.layers[layer].self_attn.attn(q, k, v, meta, kv_stored)

    def forward(self, token_ids, positions, meta):
        stored = stores_kv_ahead(meta, token_ids, self.layers[0].self_attn.attn)
        kv_slots = meta.slot_mapping if stored else None
        q, k, v, residual = self.begin(token_ids, positions, kv_slots)
        for layer in range(len(self.layers)):
            attn_out = self.attend(layer, q, k, v, meta, stored)
            if layer + 1 < len(self.layers):
                q, k, v, residual = self.between(layer + 1, positions, attn_out, residual, kv_slots)
        return self.end(attn_out, residual)


class LlamaForCausalLM(nn.Module):
    # Checkpoint projection name -> (our fused module, its shard).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    qk_norm = False

    def __init__(self, cfg: ModelConfig, max_position: int, tp: Partition = Partition()):
        """cfg: the whole model's shape (the checkpoint's); tp: the slice of it this process holds."""
        super().__init__()
        qkv_bias, o_bias = self.attention_biases(cfg)
        self.model = LlamaModel(cfg, qkv_bias, o_bias, self.qk_norm, max_position, tp)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def attention_biases(cfg: ModelConfig) -> tuple[bool, bool]:
        return cfg.attention_bias, cfg.attention_bias

    def forward(self, token_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(token_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
