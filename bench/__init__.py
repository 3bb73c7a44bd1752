"""distckpt's benchmarks: each measures distckpt against the physical limit of its storage.

Run them from the repository root as modules (``python -m bench.<name> --help``); they are not
part of the installed package. What they share (the GPT-like state dicts, the raw ``os.write`` /
``os.preadv`` baseline, the gloo rank launcher, the timing between barriers) is in
:mod:`bench.common`; docs/performance.md has the commands and the current figures.

- ``throughput``: save, load, resharded load, async save, fully parallel load and PyTorch DCP
  against raw I/O (``--sweep``: the shapes × sizes sweep of :mod:`bench.sweep`)
- ``checks``: the default load's CRC32C checks against ``verify=False`` and a raw read
- ``coop``: the cooperative (fully parallel) load against plain loads, on throttled stores
- ``files``: save and load against a plain write and read of the very files they use
- ``fixed_cost``: save and load of a 200-tensor state dict of small tensors
- ``scale``: validation, planning and ``.metadata`` of 64 … 16,384 simulated ranks (GPT-3-like, or
  ``--model deepseek``: a DeepSeek-V3-like Mixture-of-Experts model, :mod:`bench.deepseek`)
- ``moe``: Mixture-of-Experts state dicts at 1k … 20k tensors per rank, against megatron-core
- ``local_tier``: the local tier (``distckpt.local``) against persistent checkpoints
- ``gpu``: async save and load of CUDA tensors against the copy engine (``gpu_check.sh`` runs it
  with the CUDA tests)
"""
