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

from megatron.zero_bubble.te_cpu import activations, extension, norms
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


def test_a_quantized_operand_or_an_output_quantizer_is_refused():
    class Float8TensorStorage:
        pass

    with pytest.raises(KernelNotOnCpu, match="operand A of type Float8TensorStorage"):
        gemm(Float8TensorStorage(), rand(6, 4), "TN")
    with pytest.raises(KernelNotOnCpu, match="output quantizer"):
        generic_gemm(rand(8, 4), True, rand(6, 4), False, None, object(), None, None, DType.kBFloat16, False, None,
                     False, None, 0, False, False)


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
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(kernels[f"d{name}"](dy, h, None), leaf.grad)


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
