"""A float64 reference of the five server-side optimizers, written from the papers' update
rules in Keras 3's form (not from irdma's code): what the shards' float32 steps are checked
against where TensorFlow is not installed (the verbs VM). ``tests/test_optimizers.py`` checks
the shards against Keras itself."""

from __future__ import annotations

import numpy as np


class Reference:
    """One optimizer over a float64 vector; ``spec`` as :func:`irdma.wire.optimizers.parse_update`
    takes it, already parsed into ``name`` and ``args`` (Keras names)."""

    def __init__(self, name: str, args: dict[str, float | bool], n: int) -> None:
        self.name, self.a, self.t = name, args, np.zeros(n)
        self.s1, self.s2, self.s3 = np.zeros(n), np.zeros(n), np.zeros(n)
        if name in ("adagrad", "ftrl"):
            self.s1[:] = args.get("initial_accumulator_value", 0.1)

    def step(self, w: np.ndarray, g: np.ndarray, sl: slice) -> None:
        """One step on ``w[sl]`` with gradient ``g`` (both float64)."""
        a, x = self.a, w[sl]
        if self.name == "sgd":
            lr, mu = a.get("learning_rate", 0.01), a.get("momentum", 0.0)
            if mu:
                self.s1[sl] = mu * self.s1[sl] - lr * g
                x += (mu * self.s1[sl] - lr * g) if a.get("nesterov") else self.s1[sl]
            else:
                x -= lr * g
        elif self.name == "adam":
            lr, b1, b2, eps = (a.get("learning_rate", 1e-3), a.get("beta_1", 0.9), a.get("beta_2", 0.999),
                               a.get("epsilon", 1e-7))
            self.t[sl] += 1
            t = self.t[sl]
            self.s1[sl] = b1 * self.s1[sl] + (1 - b1) * g
            self.s2[sl] = b2 * self.s2[sl] + (1 - b2) * g * g
            alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
            x -= alpha * self.s1[sl] / (np.sqrt(self.s2[sl]) + eps)
        elif self.name == "adagrad":
            lr, eps = a.get("learning_rate", 1e-3), a.get("epsilon", 1e-7)
            self.s1[sl] += g * g
            x -= lr * g / np.sqrt(self.s1[sl] + eps)
        elif self.name == "rmsprop":
            lr, rho, mu, eps = (a.get("learning_rate", 1e-3), a.get("rho", 0.9), a.get("momentum", 0.0),
                                a.get("epsilon", 1e-7))
            self.s1[sl] = rho * self.s1[sl] + (1 - rho) * g * g
            if a.get("centered"):
                self.s3[sl] = rho * self.s3[sl] + (1 - rho) * g
                denom = self.s1[sl] - self.s3[sl] ** 2 + eps
            else:
                denom = self.s1[sl] + eps
            inc = lr * g / np.sqrt(denom)
            if mu > 0:
                self.s2[sl] = mu * self.s2[sl] + inc
                x -= self.s2[sl]
            else:
                x -= inc
        elif self.name == "ftrl":  # FTRL-Proximal (McMahan et al., KDD 2013), Keras's form, beta 0
            lr = a.get("learning_rate", 1e-3)
            l1, l2 = a.get("l1_regularization_strength", 0.0), a.get("l2_regularization_strength", 0.0)
            acc = self.s1[sl] + g * g
            self.s2[sl] += g - (np.sqrt(acc) - np.sqrt(self.s1[sl])) / lr * x
            x[:] = (np.clip(self.s2[sl], -l1, l1) - self.s2[sl]) / (np.sqrt(acc) / lr + 2 * l2)
            self.s1[sl] = acc
        else:
            raise ValueError(self.name)


def spec_text(name: str, args: dict[str, float | bool]) -> str:
    return " ".join([name] + [f"{k}={str(v).lower()}" if isinstance(v, bool) else f"{k}={v!r}" for k, v in args.items()])


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| (the norm-wise relative error)."""
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


#: The configurations every test runs: each optimizer, with its variants.
CONFIGS: list[tuple[str, dict[str, float | bool]]] = [
    ("sgd", {"learning_rate": 0.05}),
    ("sgd", {"learning_rate": 0.02, "momentum": 0.9, "nesterov": True}),
    ("adam", {"learning_rate": 0.01, "beta_1": 0.8}),
    ("adagrad", {"learning_rate": 0.05}),
    ("rmsprop", {"learning_rate": 0.01, "momentum": 0.5, "centered": True}),
    ("ftrl", {"learning_rate": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.1}),
]
