"""Test-wide fixtures."""

import pytest


@pytest.fixture(autouse=True)
def _fresh_attention_context():
    """mtrain's attention context is process-global (the trainer sets it per micro-batch): a test that trains
    in-process must not leave its CP group or document ids to the next test."""
    yield
    from mtrain.models.context import CONTEXT

    CONTEXT.group = CONTEXT.layout = CONTEXT.inner_group = CONTEXT.outer_group = None
    CONTEXT.local_world_size = CONTEXT.doc_ids = CONTEXT.documents = None


@pytest.fixture
def single_process_group(tmp_path):
    """A gloo process group of this process alone (ring code paths that need a group, on one rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
