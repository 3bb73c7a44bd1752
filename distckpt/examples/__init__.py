"""A small tensor/pipeline/data-parallel GPT that checkpoints with distckpt, end to end.

This package stands for *user* code: the model, its optimizers and its training loop talk to
``torch.distributed`` themselves, as any model-parallel training code does (the library proper
leaves that to ``distckpt/dist.py``). It is importable so that ``distckpt demo`` runs after a
plain ``pip install``; ``examples/train.py`` is the runnable script, docs/guide.md walks through
its ``sharded_state_dict()`` methods.

Modules:
    parallel    the layout (TP x PP x DP), process groups and the autograd-aware collectives
    model       GPTConfig and GPTModel: column/row-parallel layers, SwiGLU, stages
    optimizers  Adam (states shaped like the params) and DistributedAdam (flat DP slices)
    training    data, the pipelined train step, checkpoint save/load, ``run`` for one rank
    launch      spawn gloo ranks on this machine and collect what each returns
"""

from distckpt.examples.model import GPTConfig, GPTModel
from distckpt.examples.optimizers import Adam, DistributedAdam
from distckpt.examples.parallel import Layout, ParallelState

__all__ = ["Adam", "DistributedAdam", "GPTConfig", "GPTModel", "Layout", "ParallelState"]
