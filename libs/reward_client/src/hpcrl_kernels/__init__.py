"""The verifiers taskset id ``hpcrl-kernels``: verifiers loads a taskset by importing the module
its id names (``hpcrl_kernels``) and taking the ``Taskset`` subclass in its ``__all__``.
Everything is in :mod:`hpcrl_reward_client.verifiers`."""

from hpcrl_reward_client.verifiers import KernelTaskset

__all__ = ["KernelTaskset"]
