"""moba and xattention through the Triton kernels (Triton's CPU interpreter, in the process that
tests/test_ops_interpreter.py starts for the quick kernel tests): forward and backward equal the PyTorch path on the
same index (fp32, out 1e-5, grads 1e-4), whose equality with the float64 references tests/test_baselines_*.py show."""

import torch

from test_ops_interpreter import needs_interpreter


@needs_interpreter  # run by tests/test_ops_interpreter.py in its Triton-interpreter process (QUICK_ELSEWHERE)
def test_baselines_through_triton_kernels_in_interpreter():
    from mtrain.ops import moba_attention, partial, vertical_slash_attention, xattention_attention

    assert partial.use_triton("auto", torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 128, h, 16, generator=g) for h in (2, 1, 1)]
    dout = torch.randn(1, 128, 2, 16, generator=g)
    for kind, run in (("moba", lambda q, k, v: moba_attention(q, k, v, chunk_size=32, topk=1, block_size=16,
                                                                return_index=True)),
                      ("xattention", lambda q, k, v: xattention_attention(q, k, v, stride=4, threshold=0.5,
                                                                            block_size=16, return_index=True))):
        ours = [t.clone().requires_grad_(True) for t in base]
        out, index = run(*ours)
        out.backward(dout)
        torch_path = [t.clone().requires_grad_(True) for t in base]
        ref = vertical_slash_attention(*torch_path, index, impl="torch")
        ref.backward(dout)
        err = {"density": index.density(), "out": float((out - ref).detach().abs().max()),
               **{n: float((a.grad - b.grad).abs().max()) for n, a, b in zip("qkv", ours, torch_path)}}
        assert err["density"] < 0.9, (kind, err)
        assert err["out"] < 1e-5, (kind, err)
        assert max(err["q"], err["k"], err["v"]) < 1e-4, (kind, err)
