"""Exact on-policy mode: one batch-invariant forward shared by the embedded engine and the trainer.

The logprob an engine reports for a sampled token and the logprob the trainer recomputes for it differ
because the two run different kernels, and because a reduction's order depends on the shapes around it: a
GEMM's kernel (blocking, split-K) is picked from the number of rows, a row sum's split from the number of
rows, an attention's reduction over keys from how many keys and queries are in the call (Thinking Machines,
"Defeating Nondeterminism in LLM Inference", 2025; vLLM's batch-invariant mode and SGLang's deterministic
inference, which slime uses for "true on-policy" RL, fix the same causes with their own kernels). Here every
reduction in the forward has an order that depends on nothing but the token's own data:

- matmuls (`ops.linear`): on CPUs the rows are cut into tiles of a fixed size (`ops.tile_rows`), zero-padded,
  and each tile is its own GEMM of one fixed shape, so the library picks the same kernel for every tile
  whatever the batch; a row's result does not depend on its place in the tile (checked by
  benchmarks/exact_probe.py). On CUDA one Triton GEMM of fixed blocking, never chosen from the row count
  (`triton_ops.matmul`);
- sums (RMSNorm's mean square, softmax denominators, the log-sum-exp over the vocabulary, the sum over key
  blocks): a pairwise tree over the axis zero-padded to a power of two (`ops.tree_sum`), made of elementwise
  adds only. Zeros appended at the end change nothing: the tree over 2n values is the tree over the first n
  plus a tree of zeros. Maxima are exact in any order;
- attention (`ops.attention`): each query against key blocks of `KEY_BLOCK` keys at fixed absolute positions,
  scores and block sums from fixed-shape tile GEMMs in float32, a two-pass softmax (exact maximum, then the
  tree sums), masked keys contributing exact zeros (on CUDA one Triton kernel with an online softmax over the
  same key blocks in position order, `triton_ops.attention`; RMSNorm likewise one kernel per row). So a
  query's output is the same bits in a prompt's prefill, in a one-token decode step over a slot cache of any
  length, and in the trainer's full-sequence pass;
- the head and log-softmax (`ops.token_logprobs`): GEMM to float32 logits, exact max, tree log-sum-exp (on CUDA
  the leaves and the tree's bottom levels in one kernel, `triton_tree.vocab_tree`).

The engine (turnrl/engines/fast with `exact=True`) and the trainer (`model.exact_logprobs`) call these same
functions on the same weights in the engine's dtype (LoRA merged exactly as the weight sync merges it), so
the logprobs agree bit for bit. The trainer's backward is the ordinary one (gradients need no bitwise
agreement): custom autograd functions recompute a plain attention, GEMM or softmax for the gradient.
"""
