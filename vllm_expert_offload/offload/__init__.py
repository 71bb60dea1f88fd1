"""The offload core between placement and kernels, free of vLLM: the `expert_offload` options parsed once into
one frozen object, the per-rank expert plan, the two tiers an expert is placed in, and the process placement
(plan + host arena + routing counts). `integration/` hands vLLM's facts in and installs the vLLM hooks."""
