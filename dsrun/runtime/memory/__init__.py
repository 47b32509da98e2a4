"""What a rank holds, measured and estimated: the host allocator policy
(allocator.py), tensor accounting and the ZeRO memory estimate
(accounting.py), and the per-phase memory profile (profile.py)."""
