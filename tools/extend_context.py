#!/usr/bin/env python
"""Copy a GGUF file with a larger context window in its metadata (weights untouched).

    .venv/bin/python tools/extend_context.py DST.gguf [--src SRC.gguf] [--context 16384]

The default model's window is 8,192 tokens. To compare engines at 16K on the same weights, every
engine must accept the longer context: this copy changes only ``<arch>.context_length`` (rotary
positions continue past the trained window; the text quality there is not the point, the speed
and memory of a 16K cache are). Tensors are copied byte for byte (quantized blocks stay as they
are), so llama.cpp, transformers and hybridllm all read the same data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def extend_context(src: Path, dst: Path, context: int) -> Path:
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode()
    context_key = f"{arch}.context_length"
    if context_key not in reader.fields:
        raise SystemExit(f"error: {src} has no {context_key}")
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        value_type = field.types[0]
        if name == context_key:
            writer.add_uint32(name, context)
        elif value_type == gguf.GGUFValueType.ARRAY:
            sub_type = field.types[-1]
            if sub_type == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                values = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, values)
        elif value_type == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], value_type)
    for tensor in reader.tensors:
        # quantized data comes as (rows, bytes per row) uint8: the writer derives the element shape
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dst", type=Path)
    parser.add_argument("--src", type=Path, help="GGUF file (default: the default model)")
    parser.add_argument("--context", type=int, default=16384)
    args = parser.parse_args(argv)
    src = args.src
    if src is None:
        from hybridllm.loading.registry import default_model_path

        src = default_model_path()
    extend_context(src, args.dst, args.context)
    print(f"wrote {args.dst} (context {args.context})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
