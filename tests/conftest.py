"""Every test process sees 8 simulated CPU devices."""
import jax

jax.config.update("jax_num_cpu_devices", 8)
