"""The CPU kernel layer for Transformer Engine's Python (megatron/zero_bubble/te_cpu): each kernel does with its
arguments what TE's does (layouts, accumulation into the output, epilogues, dtypes), and refuses what it does not do.

Checked against plain torch in float64 where the arithmetic is the point, and with torch.equal where a kernel must
reproduce a formula exactly. TE's own modules over these kernels: tests/megatron/te_split_cases.py (test_te_releases.py) and
the pretrain_gpt.py launches (megatron's default layers on the CPU).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.zero_bubble.te_cpu import activations, extension, fp8, norms
from megatron.zero_bubble.te_cpu.enums import DType
from megatron.zero_bubble.te_cpu.gemm import generic_gemm
from megatron.zero_bubble.te_cpu.refusal import KernelNotOnCpu

GEN = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


def gemm(A, B, layout, D=None, accumulate=False, bias=None, grad=False, gelu=False, gelu_in=None, out_dtype=None,
         **kwargs):
    transa, transb = layout[0] == "T", layout[1] == "T"
    return generic_gemm(A, transa, B, transb, D, None, out_dtype, bias, DType.kBFloat16, gelu, gelu_in, grad, None, 0,
                        accumulate, False, **kwargs)


def test_the_three_layouts_are_the_forward_the_input_gradient_and_the_weight_gradient():
    weight, x, dy = rand(8, 4), rand(2, 3, 4), rand(2, 3, 8)
    torch.testing.assert_close(gemm(weight, x, "TN")[0], x @ weight.t())  # keeps B's leading dimensions
    torch.testing.assert_close(gemm(weight, dy, "NN")[0], dy @ weight)
    torch.testing.assert_close(gemm(x, dy, "NT")[0], dy.reshape(6, 8).t() @ x.reshape(6, 4))


def test_accumulate_adds_into_the_output_and_without_it_the_output_is_overwritten():
    x, dy = rand(6, 4), rand(6, 8)
    main_grad = rand(8, 4)
    before = main_grad.clone()
    out = gemm(x, dy, "NT", D=main_grad, accumulate=True, out_dtype=DType.kFloat32)[0]
    assert out is main_grad
    torch.testing.assert_close(main_grad, before + dy.t() @ x)
    gemm(x, dy, "NT", D=main_grad, accumulate=False, out_dtype=DType.kFloat32)
    torch.testing.assert_close(main_grad, dy.t() @ x)


def test_bf16_operands_are_multiplied_in_float32_and_rounded_once_into_the_output():
    x, dy = rand(6, 4, dtype=torch.bfloat16), rand(6, 8, dtype=torch.bfloat16)
    main_grad = rand(8, 4)
    want = main_grad + dy.float().t() @ x.float()
    gemm(x, dy, "NT", D=main_grad, accumulate=True, out_dtype=DType.kFloat32)
    assert torch.equal(main_grad, want)
    out = gemm(rand(8, 4, dtype=torch.bfloat16), x, "TN")[0]
    assert out.dtype == torch.bfloat16


def test_the_bias_is_added_in_the_forward_and_summed_for_its_gradient():
    weight, x, bias, dy = rand(8, 4), rand(6, 4), rand(8), rand(6, 8)
    torch.testing.assert_close(gemm(weight, x, "TN", bias=bias)[0], x @ weight.t() + bias)
    wgrad, bias_grad, _, _ = gemm(x, dy, "NT", bias=bias, grad=True)
    torch.testing.assert_close(wgrad, dy.t() @ x)
    torch.testing.assert_close(bias_grad, dy.sum(0))


def test_the_gelu_epilogue_keeps_its_input_and_its_gradient_uses_it():
    weight, x = rand(8, 4), rand(6, 4)
    out, _, pre_gelu, _ = gemm(weight, x, "TN", gelu=True)
    torch.testing.assert_close(pre_gelu, x @ weight.t())
    torch.testing.assert_close(out, F.gelu(pre_gelu, approximate="tanh"))
    fc2_weight, dy = rand(4, 8), rand(6, 4)
    dgrad = gemm(fc2_weight, dy, "NN", gelu=True, grad=True, gelu_in=pre_gelu)[0]
    h = pre_gelu.clone().requires_grad_(True)
    F.gelu(h, approximate="tanh").backward(dy @ fc2_weight)
    torch.testing.assert_close(dgrad, h.grad)


@pytest.mark.parametrize("argument", [{"comm_overlap": object()}, {"bulk_overlap": True}, {"extra_output": rand(2)}])
def test_userbuffers_and_extra_outputs_are_refused_not_dropped(argument):
    with pytest.raises(KernelNotOnCpu, match="generic_gemm: .* is not emulated"):
        gemm(rand(8, 4), rand(6, 4), "TN", **argument)


class Float8TensorStorage:
    """The attributes TE's per-tensor FP8 storage has (the kernels find it by its class name)."""

    def __init__(self, values: torch.Tensor, scale_inv: float, rowwise=True, columnwise=True,
                 dtype=DType.kFloat8E4M3):
        data = fp8.cast(values, torch.ones(1), dtype)
        self._fp8_dtype, self._scale_inv = dtype, torch.tensor([scale_inv])
        self._data = data if rowwise else None
        self._transpose = fp8.transposed(data) if columnwise else None
        self._transpose_invalid = not columnwise


class Float8Quantizer:  # delayed scaling's quantizer, as TE's kernels read it
    def __init__(self, scale: float, amax: float = 0.0, rowwise=True, columnwise=True):
        self.scale, self.amax = torch.tensor([scale]), torch.tensor([amax])
        self.dtype, self.rowwise_usage, self.columnwise_usage = DType.kFloat8E4M3, rowwise, columnwise


def test_a_quantized_operand_of_another_kind_or_an_output_quantizer_is_refused():
    class MXFP8TensorStorage:
        pass

    with pytest.raises(KernelNotOnCpu, match="operand A of type MXFP8TensorStorage"):
        gemm(MXFP8TensorStorage(), rand(6, 4), "TN")
    with pytest.raises(KernelNotOnCpu, match="one FP8 operand with one of type Tensor"):
        gemm(Float8TensorStorage(rand(8, 16), 1.0), rand(6, 16), "TN")
    with pytest.raises(KernelNotOnCpu, match="output quantizer"):
        generic_gemm(rand(8, 4), True, rand(6, 4), False, None, object(), None, None, DType.kBFloat16, False, None,
                     False, None, 0, False, False)


def test_the_fp8_cast_saturates_rounds_to_nearest_even_and_keeps_nan():
    values = torch.tensor([1000.0, -1000.0, 1.0625, 1.1875, float("nan"), 0.0])
    got = fp8.values_of(fp8.cast(values, torch.ones(1), DType.kFloat8E4M3), DType.kFloat8E4M3)
    assert got[:4].tolist() == [448.0, -448.0, 1.0, 1.25] and got[4].isnan() and got[5] == 0
    e5m2 = fp8.values_of(fp8.cast(torch.tensor([1e6, 3.0]), torch.tensor([2.0]), DType.kFloat8E5M2), DType.kFloat8E5M2)
    assert e5m2.tolist() == [57344.0, 6.0]


def test_fp8_gemm_reads_the_transpose_of_an_operand_used_untransposed_as_hopper_does():
    weight, dy = rand(8, 16), rand(6, 8)
    a, b = Float8TensorStorage(weight, 0.5), Float8TensorStorage(dy, 0.25)
    want = (fp8.values_of(b._data, b._fp8_dtype) @ fp8.values_of(a._data, a._fp8_dtype)) * 0.125
    a._data.zero_()  # "NN" (dgrad): A is read from its transpose only
    assert torch.equal(gemm(a, b, "NN", out_dtype=DType.kFloat32)[0], want)
    a._transpose_invalid = True
    with pytest.raises(RuntimeError, match="input A is missing column-wise usage"):
        gemm(a, b, "NN", out_dtype=DType.kFloat32)
    rowwise_only = Float8TensorStorage(dy, 1.0, columnwise=False)
    with pytest.raises(RuntimeError, match="input B is missing column-wise usage"):
        gemm(Float8TensorStorage(rand(6, 16), 1.0), rowwise_only, "NT", out_dtype=DType.kFloat32)  # wgrad: dy^T


def test_delayed_scaling_quantize_raises_amax_and_writes_data_transpose_and_scale_inverse():
    quantizer = Float8Quantizer(scale=2.0, amax=5.0)
    out = Float8TensorStorage(torch.zeros(2, 3), 1.0)
    x = torch.tensor([[1.0, -3.0, 0.25], [float("nan"), 2.0, 0.5]])
    fp8.quantize_into(out, quantizer, x, "quantize", fake_dtype=torch.float32)
    assert quantizer.amax.item() == 5.0  # kept: larger than the input's 3 (NaN ignored)
    fp8.quantize_into(out, quantizer, x * 4, "quantize", fake_dtype=torch.float32)
    assert quantizer.amax.item() == 12.0 and out._scale_inv.item() == 0.5
    assert torch.equal(out._transpose, fp8.transposed(out._data))
    assert torch.equal(out._data, fp8.cast(x * 4, torch.tensor([2.0]), DType.kFloat8E4M3))
    quantizer.columnwise_usage = False  # the existing output is made to match the usages
    fp8.quantize_into(out, quantizer, x, "quantize", fake_dtype=torch.float32)
    assert out._transpose is None and out._transpose_invalid
    with pytest.raises(KernelNotOnCpu, match="MXFP8Quantizer.*use --fp8-recipe delayed or tensorwise$"):
        fp8.quantize_into(out, type("MXFP8Quantizer", (), {})(), x, "quantize", fake_dtype=torch.float32)


def test_current_scaling_scale_is_max_over_amax_with_tes_edge_cases():
    e4m3 = DType.kFloat8E4M3
    assert fp8.scale_from_amax(torch.tensor([2.0]), e4m3, False, 0.0).item() == 224.0
    assert fp8.scale_from_amax(torch.tensor([0.0]), e4m3, False, 0.0).item() == 1.0
    assert fp8.scale_from_amax(torch.tensor([float("inf")]), e4m3, False, 0.0).item() == 1.0
    assert fp8.scale_from_amax(torch.tensor([0.0]), e4m3, False, 4.0).item() == 112.0  # the epsilon floor
    assert fp8.scale_from_amax(torch.tensor([3.0]), e4m3, True, 0.0).item() == 128.0  # 149.3 to a power of two
    assert fp8.scale_from_amax(torch.tensor([1e-45]), e4m3, False, 0.0).item() == torch.finfo(torch.float32).max


def test_the_delayed_scaling_update_rolls_each_history_and_sets_the_scale_as_tes_kernel():
    history = torch.tensor([[7.0, 0.0, 3.0], [1.0, 2.0, 9.0], [4.0, 5.0, 6.0]])  # length 3, three scales
    scale = torch.tensor([1.0, 1.0, 1.0])
    reduced = torch.tensor([8.0, 0.0, 0.0])  # scale 0: the reduced amax; 1: none (history row 0 is 0); 2: row 0
    fp8.fused_amax_and_scale_update_after_reduction(reduced, [history], [scale], "max", DType.kFloat8E4M3, 1.0)
    assert history.tolist() == [[0.0, 0.0, 0.0], [4.0, 2.0, 6.0], [8.0, 5.0, 3.0]]
    # max over the old rows 1.. and the newest, divided in float32; margin 1 halves 448
    assert torch.equal(scale, torch.tensor([224.0, 1.0, 224.0]) / torch.tensor([8.0, 1.0, 9.0]))
    history2, scale2 = torch.tensor([[2.0], [16.0]]), torch.tensor([3.0])
    fp8.fused_amax_and_scale_update_after_reduction(torch.zeros(1), [history2], [scale2], "most_recent",
                                                    DType.kFloat8E5M2, 0.0)
    assert history2.tolist() == [[0.0], [2.0]] and scale2.tolist() == [57344.0 / 2.0]


def test_an_output_of_the_wrong_shape_or_dtype_is_an_error():
    with pytest.raises(ValueError, match="output shape"):
        gemm(rand(8, 4), rand(6, 4), "TN", D=rand(6, 7))
    with pytest.raises(ValueError, match="output dtype"):
        gemm(rand(8, 4), rand(6, 4), "TN", D=rand(6, 8, dtype=torch.bfloat16), out_dtype=DType.kFloat32)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_and_rmsnorm_match_torch_forward_and_backward(zero_centered):
    x, gamma, beta, dz = rand(5, 16), rand(16), rand(16), rand(5, 16)  # the kernels compute in float32
    scale = gamma + 1 if zero_centered else gamma
    out, mu, rsigma = norms.layernorm_fwd(x, gamma, beta, 1e-5, None, None, None, 0, zero_centered)
    leaf = x.clone().requires_grad_(True)
    g, b = scale.clone().requires_grad_(True), beta.clone().requires_grad_(True)
    ref = F.layer_norm(leaf, (16,), g, b, 1e-5)
    ref.backward(dz)
    torch.testing.assert_close(out, ref.detach().to(out.dtype))
    dx, dgamma, dbeta = norms.layernorm_bwd(dz, x, mu, rsigma, gamma, 0, zero_centered)
    torch.testing.assert_close(dx, leaf.grad.to(dx.dtype))
    torch.testing.assert_close(dgamma, g.grad.to(dgamma.dtype))
    torch.testing.assert_close(dbeta, b.grad.to(dbeta.dtype))
    out, none, rsigma = norms.rmsnorm_fwd(x, gamma, 1e-5, None, None, None, 0, zero_centered)
    assert none is None and rsigma.dtype == torch.float32
    leaf, g = x.clone().requires_grad_(True), scale.clone().requires_grad_(True)
    ref = F.rms_norm(leaf, (16,), g, 1e-5)
    ref.backward(dz)
    torch.testing.assert_close(out, ref.detach().to(out.dtype))
    dx, dgamma = norms.rmsnorm_bwd(dz, x, rsigma, gamma, 0, zero_centered)
    torch.testing.assert_close(dx, leaf.grad.to(dx.dtype))
    torch.testing.assert_close(dgamma, g.grad.to(dgamma.dtype))


def test_a_norm_writes_into_the_output_it_is_given():
    x, gamma = rand(5, 16), rand(16)
    out = torch.empty(5, 16, dtype=torch.bfloat16)
    assert norms.rmsnorm_fwd(x, gamma, 1e-5, out, None, None, 0, False)[0] is out


def _swiglu(h):
    gate, linear = h.chunk(2, dim=-1)
    return F.silu(gate) * linear


@pytest.mark.parametrize("name,reference", [("gelu", lambda h: F.gelu(h, approximate="tanh")), ("silu", F.silu),
                                            ("relu", F.relu), ("swiglu", _swiglu)])
def test_activations_and_their_gradients_match_torch(name, reference):
    kernels = activations.kernels()
    h, dy = rand(5, 16).double(), None
    out = kernels[name](h, None)
    leaf = h.clone().requires_grad_(True)
    ref = reference(leaf)
    dy = rand(*ref.shape).double()
    ref.backward(dy)
    float32 = dict(rtol=1e-5, atol=1e-6)  # the kernels compute in float32, the reference in float64
    torch.testing.assert_close(out, ref.detach(), **float32)
    torch.testing.assert_close(kernels[f"d{name}"](dy, h, None), leaf.grad, **float32)
    if name != "swiglu":  # the bias gradient sums the activation's gradient over the rows
        bias_grad, grad_input = kernels[f"dbias_d{name}"](dy, h, None)
        assert torch.equal(grad_input, kernels[f"d{name}"](dy, h, None))
        torch.testing.assert_close(bias_grad, leaf.grad.sum(dim=0), **float32)


def test_bgrad_quantize_sums_the_rows_in_float32_and_passes_the_gradient_on():
    dy = rand(6, 8, dtype=torch.bfloat16)
    bias_grad, same = activations.bgrad_quantize(dy, None)
    assert torch.equal(bias_grad, dy.float().sum(dim=0).to(torch.bfloat16)) and torch.equal(same, dy)


def test_a_missing_kernel_stops_the_run_in_one_line_naming_it_and_the_fix():
    tex = extension.build()
    with pytest.raises(KernelNotOnCpu) as refused:
        tex.fused_attn_fwd(1, 2)
    line = str(refused.value)
    assert "\n" not in line and "tex.fused_attn_fwd" in line and "NVTE_FUSED_ATTN=0" in line
    with pytest.raises(KernelNotOnCpu, match="tex.fused_rope_forward .* --no-rope-fusion"):
        tex.fused_rope_forward()


def test_the_dtype_enumeration_has_the_members_tes_python_checks():
    assert set(extension.build().DType.__members__) == {"kByte", "kInt32", "kFloat32", "kFloat16", "kBFloat16",
                                                        "kFloat8E4M3", "kFloat8E5M2", "kFloat4E2M1"}


def test_the_grouped_gemm_is_one_gemm_per_group_into_its_outputs_or_row_blocks_of_one():
    from megatron.zero_bubble.te_cpu.gemm import te_general_grouped_gemm

    weights, xs = [rand(8, 4), rand(8, 4)], [rand(3, 4), rand(5, 4)]
    single = torch.zeros(8, 8)
    no_bias = [torch.Tensor(), torch.Tensor()]
    te_general_grouped_gemm(weights, True, xs, False, [single], DType.kFloat32, [3, 5], no_bias, DType.kBFloat16, True,
                            no_bias, False, None, 0, False, False, 0)
    torch.testing.assert_close(single, torch.cat([xs[0] @ weights[0].t(), xs[1] @ weights[1].t()]))
    dys = [rand(3, 8), rand(5, 8)]
    wgrads = [rand(8, 4), rand(8, 4)]
    before = [w.clone() for w in wgrads]
    bias_grads = [torch.empty(8), torch.empty(8)]
    returned = te_general_grouped_gemm(xs, False, dys, True, wgrads, DType.kFloat32, [3, 5], bias_grads,
                                       DType.kFloat32, False, no_bias, True, None, 0, True, False, 0)
    for i in range(2):
        torch.testing.assert_close(wgrads[i], before[i] + dys[i].t() @ xs[i])
        torch.testing.assert_close(returned[i], dys[i].sum(0))
    with pytest.raises(KernelNotOnCpu, match="GELU epilogue"):
        te_general_grouped_gemm(weights, True, xs, False, [single], DType.kFloat32, [3, 5], no_bias, DType.kBFloat16,
                                True, [torch.empty(3, 8), torch.empty(5, 8)], False, None, 0, False, False, 0)


def test_the_softmax_kernels_mask_scale_and_differentiate_as_tes():
    from megatron.zero_bubble.te_cpu import softmax

    scores, dy = rand(2, 4, 4), rand(2, 4, 4)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[:, 3] = True
    torch.testing.assert_close(softmax.scaled_masked_softmax_forward(scores, mask, 0.5),
                               torch.softmax((scores * 0.5).masked_fill(mask, -10000.0), -1))
    causal = softmax.scaled_upper_triang_masked_softmax_forward(scores, 2.0)
    assert torch.equal(causal.triu(1), torch.zeros_like(causal))
    torch.testing.assert_close(causal.sum(-1), torch.ones(2, 4))
    leaf = scores.clone().requires_grad_(True)
    torch.softmax(leaf * 0.5, -1).backward(dy)
    y = softmax.scaled_softmax_forward(scores, 0.5)
    torch.testing.assert_close(softmax.softmax_backward(dy, y, 0.5), leaf.grad)


def test_the_kernel_module_has_the_names_tes_python_uses_and_no_others():
    tex = extension.build()
    assert hasattr(tex, "generic_gemm") and hasattr(tex, "fused_attn_fwd")  # implemented; named by TE, refusing
    assert not hasattr(tex, "cache_clear")  # a probe for a name TE never uses finds nothing, as on TE's extension


def test_te_layers_on_the_cpu_without_tes_python_are_refused_naming_the_install(monkeypatch):
    import argparse

    from megatron.zero_bubble.training import checks
    from megatron.zero_bubble.training.flags import StartupRefusal

    monkeypatch.setattr(checks, "te_python_version", lambda: None)
    monkeypatch.setattr(checks, "cuda_available", lambda: False)
    args = argparse.Namespace(distributed_backend="gloo", transformer_impl="transformer_engine", num_experts=None,
                              add_bias_linear=True, data_path=None, train_data_path=None, valid_data_path=None,
                              test_data_path=None, data_args_path=None, per_split_data_args_path=None, mock_data=True)
    with pytest.raises(StartupRefusal, match=r"needs Transformer Engine's Python \(pip install --no-deps "
                                             r"transformer-engine==2.20.2 onnxscript einops\); or use --transformer-impl local"):
        checks.check_without_zero_bubble(args)
