"""The enumerations `transformer_engine_torch` exports, with the values of TE's C++ headers.

TE's Python checks some of them member for member at import (`pytorch/constants.py` against `DType`,
`cpp_extensions/fused_attn.py` against `NVTE_Fused_Attn_Backend`), so the members are TE's own names.
"""
from __future__ import annotations

import enum


class DType(enum.IntEnum):  # transformer_engine.h, NVTEDType (the members the torch extension exports)
    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10


class FP8FwdTensors(enum.IntEnum):
    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5


class NVTEScalingMode(enum.IntEnum):
    NVTE_DELAYED_TENSOR_SCALING = 0
    NVTE_MXFP8_1D_SCALING = 1
    NVTE_BLOCK_SCALING_1D = 2
    NVTE_BLOCK_SCALING_2D = 3
    NVTE_NVFP4_1D_SCALING = 4
    NVTE_INVALID_SCALING = 100


class CommOverlapType(enum.IntEnum):  # Userbuffers: refused by the kernels that would take it
    RS = 0
    AG = 1


class CommOverlapAlgo(enum.IntEnum):
    BULK_OVERLAP_AG = 0
    BULK_OVERLAP_RS = 1
    SPLIT_PIPELINED_AG_P2P = 2
    SPLIT_PIPELINED_RS = 3
    SPLIT_PIPELINED_RS_P2P = 4
    ATOMIC_GEMM_RS = 5
    ATOMIC_GEMM_AG_P2P = 6
    ATOMIC_GEMM_RS_P2P = 7


# Attention's enumerations: TE's fused attention is not implemented here (its unfused PyTorch backend is what runs),
# but its Python names these members at import.
NVTE_QKV_Format = enum.IntEnum("NVTE_QKV_Format", [
    "NVTE_SBHD", "NVTE_BSHD", "NVTE_THD", "NVTE_SBHD_2BSHD", "NVTE_BSHD_2SBHD", "NVTE_THD_2BSHD", "NVTE_THD_2SBHD",
    "NVTE_BHSD", "NVTE_QKV_Format_NOT_SET"], start=0)
NVTE_QKV_Layout = enum.IntEnum("NVTE_QKV_Layout", [
    "NVTE_SB3HD", "NVTE_SBH3D", "NVTE_SBHD_SB2HD", "NVTE_SBHD_SBH2D", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD",
    "NVTE_BSH3D", "NVTE_BSHD_BS2HD", "NVTE_BSHD_BSH2D", "NVTE_BSHD_BSHD_BSHD", "NVTE_T3HD", "NVTE_TH3D",
    "NVTE_THD_T2HD", "NVTE_THD_TH2D", "NVTE_THD_THD_THD", "NVTE_SBHD_BSHD_BSHD", "NVTE_BSHD_SBHD_SBHD",
    "NVTE_THD_BSHD_BSHD", "NVTE_THD_SBHD_SBHD", "NVTE_Paged_KV_BSHD_BSHD_BSHD", "NVTE_Paged_KV_BSHD_SBHD_SBHD",
    "NVTE_Paged_KV_SBHD_BSHD_BSHD", "NVTE_Paged_KV_SBHD_SBHD_SBHD", "NVTE_Paged_KV_THD_BSHD_BSHD",
    "NVTE_Paged_KV_THD_SBHD_SBHD", "NVTE_BHSD_BHSD_BHSD", "NVTE_QKV_Layout_NOT_SET"], start=0)
NVTE_Bias_Type = enum.IntEnum("NVTE_Bias_Type", [
    "NVTE_NO_BIAS", "NVTE_PRE_SCALE_BIAS", "NVTE_POST_SCALE_BIAS", "NVTE_ALIBI"], start=0)
NVTE_Mask_Type = enum.IntEnum("NVTE_Mask_Type", [
    "NVTE_NO_MASK", "NVTE_PADDING_MASK", "NVTE_CAUSAL_MASK", "NVTE_PADDING_CAUSAL_MASK",
    "NVTE_CAUSAL_BOTTOM_RIGHT_MASK", "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK", "NVTE_ARBITRARY_MASK"], start=0)
NVTE_Softmax_Type = enum.IntEnum("NVTE_Softmax_Type", [
    "NVTE_VANILLA_SOFTMAX", "NVTE_OFF_BY_ONE_SOFTMAX", "NVTE_LEARNABLE_SOFTMAX"], start=0)


class NVTE_Fused_Attn_Backend(enum.IntEnum):
    NVTE_No_Backend = -1
    NVTE_F16_arbitrary_seqlen = 1
    NVTE_FP8 = 2


NVTERoutingMapFormat = enum.IntEnum("NVTERoutingMapFormat", ["BYTEMAP", "BITMAP_U8"], start=0)
NVTEQBHistogramMode = enum.IntEnum("NVTEQBHistogramMode", ["TWO_KERNEL", "FUSED_ATOMIC"], start=0)

# Enumerations whose members TE's Python checks whole (2.20's constants.py against DType): never extended.
CLOSED = frozenset({"DType"})
ENUMS = {e.__name__: e for e in (DType, FP8FwdTensors, FP8BwdTensors, NVTEScalingMode, CommOverlapType,
                                CommOverlapAlgo, NVTE_QKV_Format, NVTE_QKV_Layout, NVTE_Bias_Type, NVTE_Mask_Type,
                                NVTE_Softmax_Type, NVTE_Fused_Attn_Backend, NVTERoutingMapFormat,
                                NVTEQBHistogramMode)}
