"""Autocast on "tpu": placeholder until the AutocastPrivateUse1 kernels land (see register)."""


def register() -> None:
    return None
