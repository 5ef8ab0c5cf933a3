"""Activation memory: the bytes autograd keeps for backward, from a model's config.

Counted tensor by tensor from what the Hugging Face implementations compute in training
(read off modeling_llama.py and modeling_gpt2.py, and checked against `saved_tensors_hooks`
in tests/planning/test_activation_memory.py). Notation: T = micro_batch x seq_len tokens,
h hidden, i MLP width, e bytes of the compute dtype, V vocabulary, n query heads of width d,
k key/value heads.

Llama family (RMSNorm, rotary, gated SiLU MLP, grouped-query attention), per layer:
- each RMSNorm (2): its input upcast to fp32 (4Th), the fp32 rsqrt (4T), the normalized
  input before the weight (eTh; in fp32 it is the fp32 product itself)
- q/k/v projections' shared input (eTh) and o_proj's input (e.T.n.d)
- attention, eager: q, and k and v repeated to n heads (3 e.T.n.d); the fp32 softmax
  (4.b.n.s^2) and its cast to the compute dtype (e.b.n.s^2, none in fp32)
- attention, SDPA (fused kernels): q (e.T.n.d), k and v (2 e.T.k.d), the output (shared with
  o_proj's input) and the fp32 log-sum-exp (4.b.n.s)
- MLP: the input (eTh), gate output, SiLU output, up output, their product (4 e.T.i)

GPT-2, per layer: LayerNorm inputs (2 eTh) and statistics (2 x 2 x 4T), c_attn and c_fc inputs
(2 eTh), q, k^T, v (3 eTh), eager scores: softmax output, dropout mask and dropped
probabilities (b.n.s^2 each), c_proj input (eTh), residual and MLP dropout masks (2 Th), the
GELU's intermediates (4 e.T.i for gelu_new: x, x^3, tanh, the sum), c_proj input (e.T.i).
Dropout masks are one byte per element on a GPU and e bytes on a CPU (the CPU kernel keeps
the mask in the compute dtype).

Outside the layers: token ids (8T), the final norm, the LM head's input (eTh), and for the
Llama family rotary's cos and sin (2 e.T.d), made once and read by every layer. The logits are
counted apart: the loss upcasts them to fp32 and keeps its log-softmax (4TV saved); their peak
adds the logits returned to the caller (eTV) and the two fp32 gradients of backward's first
step (8TV).

The peak of a step is what is saved plus the larger of two moments that never coexist
(measured op by op, tests/planning/test_long_sequence_memory_measured.py): the loss's backward
(the logits' peak), and one layer's backward, later, once the logits are freed: the layer
recomputed (with checkpointing), the transients below, and the gradients its MLP's backward
holds beside them (two of width i, 2 e.T.i; a tiled MLP's are in its tile's).

With gradient checkpointing each layer keeps only its input (eTh), inputs all layers share are
kept once (GPT-2's eager attention mask, e.b.s^2), and one layer's full set exists again while
it is recomputed in backward.

Long sequences (`LongSequence`): with Ulysses sequence parallelism over N ranks each rank holds
T = b.s/N tokens, so every term above is counted at s/N, and the attention kernel's inputs (1/N
of the heads over the whole sequence) are the same bytes; what is added is the kernel's output,
no longer shared with o_proj's input (e.T.n.d), key/value heads replicated up to N when there are
fewer (sequence/attention.py), the all-to-all's two staging buffers (send and receive) of the
largest exchange, q (2 e.T.n.d), alive while one layer's attention exchanges, and the whole
sequence's int64 positions twice (gathered by the attention; the batch's own, which the shard
slices as it does the ids and labels: 8 b.s each beyond the slice's 8T). A tiled MLP keeps
only its input: the 4 e.T.i of the MLP are gone, and backward's recompute of one tile of tau
tokens holds that tile's intermediates and their gradients (8 e.tau.i). Offloaded activations
move each checkpointed layer's input (eTh) to host memory, pinned, so rounded up to a power of
two by torch's pinned allocator; the recomputed layer's input comes back for its recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerotrain.planning.pinned_memory import pinned_bytes

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED = (*LLAMA_FAMILY, "gpt2")
# Tensors of width i a GPT-2 activation keeps (NewGELU's elementwise chain keeps four).
_GELU_SAVED = {"gelu_new": 4, "gelu_fast": 4, "gelu": 1, "gelu_pytorch_tanh": 1, "relu": 1, "quick_gelu": 2}


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd keeps during one micro-batch's forward, by where they are kept."""

    layers: int
    per_layer_bytes: int
    """One decoder layer's saved tensors, without checkpointing."""
    checkpoint_per_layer_bytes: int
    """With gradient checkpointing: what each layer keeps (its input)."""
    outside_layers_bytes: int
    """Embeddings' ids, final norm, LM head input; the logits excluded."""
    checkpoint_shared_bytes: int
    """With gradient checkpointing: inputs every layer shares, kept once (GPT-2's eager mask)."""
    selective_per_layer_bytes: int
    """With selective checkpointing: the layer's input and its matmul and attention outputs."""
    logits_saved_bytes: int
    """What the loss keeps of the logits (fp32 log-softmax, targets)."""
    logits_peak_bytes: int
    """The LM head and loss at their peak: logits, saved log-softmax, two fp32 gradients."""
    attention: str
    transient_bytes: int = 0
    """Alive for a moment at the peak: the all-to-all's staging buffers, one tile's recompute."""
    offloaded_per_layer_bytes: int = 0
    """With offloaded activations: each checkpointed layer's input, moved to host memory."""
    layer_gradient_bytes: int = 0
    """Gradients one layer's backward holds beside its saved tensors (its MLP's, 2 e.T.i untiled)."""

    def host(self, gradient_checkpointing: bool | str) -> int:
        """Host bytes of offloaded activations: every checkpointed layer's input, pinned (0 when
        nothing is offloaded, or without checkpointing: only checkpointed layers offload)."""
        if checkpointing_mode(gradient_checkpointing) == "none":
            return 0
        return self.layers * pinned_bytes(self.offloaded_per_layer_bytes)

    def saved(self, gradient_checkpointing: bool | str) -> int:
        """Bytes saved at the end of the forward (what `saved_tensors_hooks` sees, and with selective
        checkpointing the outputs its policy keeps). `gradient_checkpointing`: False, True (whole
        layers) or "selective"."""
        mode = checkpointing_mode(gradient_checkpointing)
        if mode == "full":
            kept = self.layers * self.checkpoint_per_layer_bytes + self.checkpoint_shared_bytes
        elif mode == "selective":
            kept = self.layers * self.selective_per_layer_bytes + self.checkpoint_shared_bytes
        else:
            kept = self.layers * self.per_layer_bytes
        if mode != "none":  # offloaded inputs live on the host (`host`), not here
            kept -= self.layers * self.offloaded_per_layer_bytes
        return kept + self.outside_layers_bytes + self.logits_saved_bytes

    def total(self, gradient_checkpointing: bool | str) -> int:
        """The peak: saved tensors, then the larger of the loss's backward (the logits' peak) and one
        layer's (its recompute, the transients, its gradients); the logits are freed before any layer's."""
        return self.saved(gradient_checkpointing) - self.logits_saved_bytes + max(
            self.logits_peak_bytes, self.layer_backward(gradient_checkpointing))

    def layer_backward(self, gradient_checkpointing: bool | str) -> int:
        """Bytes one layer's backward adds to what is saved: the layer recomputed (with checkpointing;
        its input back from the host when offloaded), the transients, the gradients it holds."""
        mode = checkpointing_mode(gradient_checkpointing)
        recompute = {"none": 0, "full": self.per_layer_bytes,
                     "selective": max(0, self.per_layer_bytes - self.selective_per_layer_bytes)}[mode]
        if mode != "none":  # the recomputed layer's input, back from the host
            recompute += self.offloaded_per_layer_bytes
        return recompute + self.transient_bytes + self.layer_gradient_bytes


def checkpointing_mode(gradient_checkpointing: bool | str) -> str:
    """"none", "full" or "selective" from a train config's or a rung's value (False, True, "selective")."""
    if gradient_checkpointing in ("selective", "full", "none"):
        return str(gradient_checkpointing)
    return "full" if gradient_checkpointing else "none"


@dataclass(frozen=True)
class LongSequence:
    """The long-sequence switches of `zerotrain train` (issue 37, DeepSpeed's ALST)."""

    sequence_parallel: int = 1
    """Ulysses ranks sharing each sequence (training.sequence_parallel_size)."""
    tiled_mlp: bool | int = False
    """training.tiled_mlp: False; True (DeepSpeed's rule: tiles as long as the model is wide); or tokens per tile."""
    offload_activations: bool = False
    """training.offload_activations: checkpointed layers' inputs kept in host memory."""

    @classmethod
    def of_train_config(cls, cfg) -> LongSequence:
        """The switches of a `zerotrain train` config (a TrainConfig): training.* and, for the
        sequence-parallel size, its DeepSpeed section's sequence_parallel_size."""
        t = cfg.training
        sp = t.sequence_parallel_size if t.sequence_parallel_size > 1 else cfg.zero_dict().get("sequence_parallel_size", 1)
        return cls(int(sp or 1), t.tiled_mlp, bool(t.offload_activations))

    def tile_tokens(self, tokens: int, hidden: int) -> int | None:
        """Tokens in one MLP tile for `tokens` rows (runtime/tiled_mlp.py's rule), None when not tiled."""
        if self.tiled_mlp is False:
            return None
        if self.tiled_mlp is True:  # ceil(rows / ceil(seq / hidden)) with rows = tokens: about `hidden`
            return min(tokens, hidden) if tokens else 0
        return min(tokens, int(self.tiled_mlp))


def estimate_activations(model_config, seq_len: int, micro_batch: int, dtype: torch.dtype,
                         attention: str = "sdpa", device_type: str = "cuda",
                         loss_chunk_tokens: int | None = None,
                         long_sequence: LongSequence = LongSequence()) -> ActivationEstimate:
    """The activation bytes of one micro-batch of `micro_batch` x `seq_len` tokens.

    Args:
        model_config: a transformers PretrainedConfig of a supported architecture.
        dtype: the compute dtype.
        attention: "sdpa" (fused kernels keep no score matrix) or "eager".
        device_type: "cuda" or "cpu": dropout masks are bytes on a GPU, dtype-sized on a CPU.
        loss_chunk_tokens: the LM head and loss a chunk of this many tokens at a time
            (zerotrain train's training.loss_chunk_tokens): one chunk's logits at most.
        long_sequence: sequence parallelism, tiled MLP, offloaded activations; the bytes are one
            rank's, which holds seq_len / sequence_parallel tokens of each sample.
    Raises ValueError for an architecture the model does not cover, or eager attention with
    sequence parallelism (refused by zerotrain: it is O(seq^2)).
    """
    kind = getattr(model_config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"activation memory is modelled for {', '.join(SUPPORTED)}; "
                         f"this model is {kind!r}")
    if attention not in ("sdpa", "eager"):
        raise ValueError(f'attention must be "sdpa" or "eager", got {attention!r}')
    sp = long_sequence.sequence_parallel
    if sp > 1 and attention == "eager":
        raise ValueError("sequence parallelism runs on sdpa attention: eager keeps the seq x seq score "
                         "matrices it exists to avoid (use --attention sdpa)")
    e = torch.empty(0, dtype=dtype).element_size()
    b, s = micro_batch, -(-seq_len // sp)  # one rank's slice of each sample
    t = b * s
    if kind == "gpt2":
        per_layer, outside, layers, vocab = _gpt2(model_config, b, s, e, attention, device_type)
        selective = _gpt2_selective(model_config, b, s, e, attention)
    else:
        per_layer, outside, layers, vocab = _llama(model_config, b, s, e, attention)
        selective = _llama_selective(model_config, b, s, e, attention)
    transient = 0
    if kind != "gpt2":  # rotary's cos and sin
        outside += 2 * e * t * _heads(model_config)[2]
    if sp > 1:
        kernel_out, kv_extra, q_bytes = _ulysses_extra(model_config, t, e, sp)
        per_layer += kernel_out + kv_extra
        selective += kv_extra  # the kernel's output is kept by the policy already
        transient += 2 * q_bytes
        # whole-sequence positions (gathered; the batch's), ids and labels beyond the slice's own
        outside += 2 * 8 * b * seq_len + 2 * 8 * (b * seq_len - t)
    mlp_width = (model_config.n_inner or 4 * model_config.n_embd) if kind == "gpt2" else model_config.intermediate_size
    layer_gradients = 2 * e * t * mlp_width
    tile = long_sequence.tile_tokens(t, _hidden(model_config))
    if tile is not None:
        mlp_saved, mlp_selective, tile_peak = _tiled_mlp_savings(model_config, t, tile, e)
        per_layer -= mlp_saved
        selective -= mlp_selective
        transient += tile_peak
        layer_gradients = 0  # a tile's gradients are in its peak
    outside += 8 * t  # token ids (int64), kept by the embedding
    if loss_chunk_tokens:  # a chunk's logits live only inside its checkpoint; the targets are kept
        c = min(t, loss_chunk_tokens)
        logits_saved, logits_peak = 8 * t, e * c * vocab + 4 * c * vocab + 8 * c * vocab + 8 * t
    else:
        logits_saved = 4 * t * vocab + 8 * t
        logits_peak = e * t * vocab + logits_saved + 8 * t * vocab
    return ActivationEstimate(
        layers=layers,
        per_layer_bytes=per_layer,
        checkpoint_per_layer_bytes=e * t * _hidden(model_config),
        # GPT-2's eager attention takes a materialized b x 1 x s x s mask, an input of every layer.
        checkpoint_shared_bytes=e * b * s * s if kind == "gpt2" and attention == "eager" else 0,
        selective_per_layer_bytes=selective,
        outside_layers_bytes=outside,
        logits_saved_bytes=logits_saved,
        logits_peak_bytes=logits_peak,
        attention=attention,
        transient_bytes=transient,
        offloaded_per_layer_bytes=e * t * _hidden(model_config) if long_sequence.offload_activations else 0,
        layer_gradient_bytes=layer_gradients,
    )


def _heads(c) -> tuple[int, int, int]:
    """Query heads, key/value heads, head width."""
    if c.model_type == "gpt2":
        return c.n_head, c.n_head, c.n_embd // c.n_head
    n = c.num_attention_heads
    return n, getattr(c, "num_key_value_heads", None) or n, getattr(c, "head_dim", None) or c.hidden_size // n


def _ulysses_extra(c, t: int, e: int, sp: int) -> tuple[int, int, int]:
    """Sequence parallelism's additions per layer for `t` local tokens: the kernel's own output
    (o_proj reads the all-to-all's result instead), the key/value heads replicated up to `sp`,
    and the bytes of q, the largest exchange."""
    n, k, d = _heads(c)
    q = e * t * n * d
    return q, 2 * e * t * max(0, sp - k) * d, q


def _tiled_mlp_savings(c, t: int, tile: int, e: int) -> tuple[int, int, int]:
    """A tiled MLP against an untiled one: bytes no longer saved per layer, no longer kept by selective
    checkpointing (none: its policy keeps the tiles' matmul outputs, no_grad or not; measured), and
    one tile's recompute at the peak."""
    if c.model_type == "gpt2":
        i = c.n_inner or 4 * c.n_embd
        saved = (_GELU_SAVED.get(c.activation_function, 4) + 1) * e * t * i
        return saved, 0, (_GELU_SAVED.get(c.activation_function, 4) + 1) * 2 * e * tile * i
    i = c.intermediate_size
    return 4 * e * t * i, 0, 8 * e * tile * i


def _hidden(c) -> int:
    return c.n_embd if c.model_type == "gpt2" else c.hidden_size


def _llama(c, b: int, s: int, e: int, attention: str) -> tuple[int, int, int, int]:
    t, h, i = b * s, c.hidden_size, c.intermediate_size
    n = c.num_attention_heads
    k = getattr(c, "num_key_value_heads", None) or n
    d = getattr(c, "head_dim", None) or h // n
    # fp32 upcast of the input, rsqrt, normalized input (in fp32 the product is the normalized input)
    rms_norm = 4 * t * h + 4 * t + e * t * h
    attn_in, o_in = e * t * h, e * t * n * d
    if attention == "eager":
        scores = 4 * b * n * s * s + (e * b * n * s * s if e != 4 else 0)
        attn = 3 * e * t * n * d + scores + o_in
    else:
        attn = e * t * n * d + 2 * e * t * k * d + o_in + 4 * b * n * s
    mlp = e * t * h + 4 * e * t * i
    per_layer = 2 * rms_norm + attn_in + attn + mlp
    outside = rms_norm + e * t * h  # final norm, LM head input
    return per_layer, outside, c.num_hidden_layers, c.vocab_size


def _gpt2(c, b: int, s: int, e: int, attention: str, device_type: str) -> tuple[int, int, int, int]:
    t, h = b * s, c.n_embd
    i = c.n_inner or 4 * h
    n = c.n_head
    mask = 1 if device_type == "cuda" else e  # bytes per element of a dropout mask

    def dropout(p: float, elements: int) -> int:
        return mask * elements if p > 0 else 0

    layer_norm = e * t * h + 2 * 4 * t  # input; mean and rstd (fp32 on a GPU, small either way)
    qkv = 3 * e * t * h  # q, k^T, v
    if attention == "eager":
        probs = b * n * s * s
        scores = e * probs + (dropout(c.attn_pdrop, probs) + e * probs if c.attn_pdrop > 0 else 0)
    else:
        scores = 4 * b * n * s  # log-sum-exp; the output is c_proj's input
    attn = e * t * h + qkv + scores + e * t * h + dropout(c.resid_pdrop, t * h)  # c_attn in, ..., c_proj in
    gelu = _GELU_SAVED.get(c.activation_function, 4)
    mlp = e * t * h + gelu * e * t * i + e * t * i + dropout(c.resid_pdrop, t * h)
    per_layer = 2 * layer_norm + attn + mlp
    outside = dropout(c.embd_pdrop, t * h) + 8 * s + layer_norm + e * t * h  # positions, ln_f, LM head input
    return per_layer, outside, c.n_layer, c.vocab_size


# Selective checkpointing (train/selective_checkpoint.py) keeps a layer's input and the outputs of its
# matrix multiplies and attention kernel; norms, rotary, activations and casts are recomputed.
def _llama_selective(c, b: int, s: int, e: int, attention: str) -> int:
    t, h, i = b * s, c.hidden_size, c.intermediate_size
    n = c.num_attention_heads
    k = getattr(c, "num_key_value_heads", None) or n
    d = getattr(c, "head_dim", None) or h // n
    projections = e * t * (n * d + 2 * k * d + h + 2 * i + h)  # q, k, v, o; gate, up, down
    if attention == "eager":
        kernel = e * b * n * s * s + e * t * n * d  # the two batched matmuls: scores, weights x values
    else:
        kernel = e * t * n * d + 4 * b * n * s  # the fused kernel's output and log-sum-exp
    return e * t * h + projections + kernel


def _gpt2_selective(c, b: int, s: int, e: int, attention: str) -> int:
    t, h = b * s, c.n_embd
    i = c.n_inner or 4 * h
    n = c.n_head
    projections = e * t * (3 * h + h + i + h)  # c_attn, attention c_proj, c_fc, MLP c_proj (addmm)
    kernel = e * b * n * s * s + e * t * h if attention == "eager" else e * t * h + 4 * b * n * s
    return e * t * h + projections + kernel
