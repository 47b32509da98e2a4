"""Parallelism beyond data parallelism: the one parallelism mesh every process
group comes from (mesh.py; its degrees declared once, degrees.py, or adopted
from an mpu, mpu.py), and the pipeline, tensor, sequence (Ulysses) and expert
(MoE) parallelism built on it. runtime/engine/compose.py applies them."""
