"""Shared test setup: 8 simulated CPU devices and float64, before any device use."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)
