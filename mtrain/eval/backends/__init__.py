"""Eval backends behind one interface (`base.Backend`): `hf` (transformers, default) and `vllm` (optional extra).

Load one with `mtrain.eval.make_backend(name, model_path, **options)`; heavy libraries import on first use.
"""
