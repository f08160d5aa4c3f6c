import pytest
import torch

# The tests run many tiny operations; one intra-op thread avoids oversubscription on small shared machines.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
