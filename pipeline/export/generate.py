"""Text generation with transformers' `generate` (its KV cache, its sampling) on an exported model."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from pipeline.config import ConfigError
from pipeline.console import library_output_to_log


def load(folder: str | Path):
    """(model in eval mode, tokenizer) of an export folder; our own Prism code is trusted, nothing else."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"{folder}: no config.json; pass a `prism export` folder or a checkpoint")
    try:
        ours = json.loads(config.read_text()).get("model_type") == "prism"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config}: not valid JSON ({e}); export the checkpoint again with prism export") from None
    try:
        with library_output_to_log():  # transformers' "Loading weights" bar is library output, not ours
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=ours).eval()
            return model, AutoTokenizer.from_pretrained(folder, trust_remote_code=ours)
    except OSError as e:  # transformers' word for a missing or unreadable weights/tokenizer file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{folder}: cannot load the export ({first}); export the checkpoint again with prism export"
        ) from None


def generate(model_path, prompt, max_new_tokens=64, temperature=0.8, top_k=50, top_p=1.0, seed=0, stream=True):
    """Continue ``prompt``; streams to stdout and returns the new text. A checkpoint is exported (fp32) to a
    temporary folder first."""
    if (Path(model_path) / "config.json").is_file():
        return _generate(model_path, prompt, max_new_tokens, temperature, top_k, top_p, seed, stream)
    from pipeline.export.hf import export

    with tempfile.TemporaryDirectory(prefix="prism-generate-") as tmp:
        export(model_path, Path(tmp) / "hf", "fp32", log=False)
        return _generate(Path(tmp) / "hf", prompt, max_new_tokens, temperature, top_k, top_p, seed, stream)


def _generate(folder, prompt, max_new_tokens, temperature, top_k, top_p, seed, stream):
    import torch
    from transformers import TextStreamer

    model, tokenizer = load(folder)
    inputs = tokenizer(prompt, return_tensors="pt")
    if inputs.input_ids.shape[1] == 0:
        raise ConfigError("--prompt is empty after tokenization; pass some text")
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)  # top_k 0: off
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            **(sampling if temperature > 0 else {"do_sample": False}),
            streamer=TextStreamer(tokenizer) if stream else None,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, inputs.input_ids.shape[1] :])


DEMO_PROMPT = "The history of the"


def demo_continuations(checkpoints: dict[str, Path], max_new_tokens: int = 24) -> str:
    """`prism demo`'s last lines: a greedy continuation of one prompt from each arm's final checkpoint, through
    the same export + transformers path a user takes."""
    lines = [f'Greedy continuations of "{DEMO_PROMPT}" (prism generate, {max_new_tokens} tokens):']
    for arm, checkpoint in checkpoints.items():
        text = generate(checkpoint, DEMO_PROMPT, max_new_tokens, temperature=0.0, stream=False)
        lines.append(f"  {arm:>7}: {DEMO_PROMPT!r} -> {text!r}")
    return "\n".join(lines)
