"""Configuration of a Prism Transformer for Hugging Face `transformers` (loaded with trust_remote_code=True).

A Prism model is a pre-norm decoder whose attention differs per layer: layer l has heads_per_layer[l] heads
of head_dim_per_layer[l] dims (their product is hidden_size in every layer). Everything else is one shape.
This file is copied into every export of a Prism checkpoint (`prism export`) next to modeling_prism.py.
"""

from transformers import PretrainedConfig


class PrismConfig(PretrainedConfig):
    model_type = "prism"

    vocab_size: int = 8192
    hidden_size: int = 192
    intermediate_size: int = 512  # SwiGLU hidden width
    num_hidden_layers: int = 8
    heads_per_layer: list[int] | None = None  # one entry per layer
    head_dim_per_layer: list[int] | None = None  # hidden_size // heads_per_layer[l]
    max_position_embeddings: int = 1024  # the context the model was trained at
    norm: str = "layernorm"  # "layernorm" (with bias) or "rmsnorm"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        heads = self.heads_per_layer or [12] * self.num_hidden_layers
        self.heads_per_layer = list(heads)
        self.head_dim_per_layer = list(self.head_dim_per_layer or [self.hidden_size // h for h in heads])
        if not len(self.heads_per_layer) == len(self.head_dim_per_layer) == self.num_hidden_layers:
            raise ValueError("heads_per_layer and head_dim_per_layer need one entry per layer")
        if any(h * d != self.hidden_size for h, d in zip(self.heads_per_layer, self.head_dim_per_layer)):
            raise ValueError("every layer's heads x head_dim must equal hidden_size")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm={self.norm!r}: choose layernorm or rmsnorm")
