"""The one table of dtypes: the names of --precision / --dtype, and safetensors' names (its file header)."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}

__all__ = ["DTYPES", "SAFETENSORS_DTYPES", "TORCH_DTYPES"]
