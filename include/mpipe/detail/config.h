#pragma once

// Note [Header-only mode]
// ~~~~~~~~~~~~~~~~~~~~~~~
// mpipe's implementation lives in include/mpipe/detail/*-inl.h, in the way of
// fmt's format-inl.h. By default (the target mpipe::mpipe) the translation
// units in src/ compile those files once into libmpipe, and the public headers
// never include them, so a program's own files parse only the declarations.
// With MPIPE_HEADER_ONLY defined (the target mpipe::mpipe_header_only) the
// first public mpipe header a file includes pulls every -inl.h file after its
// own declarations (mpipe/detail/header_only.h), and the program links
// LibTorch alone.
//
// What that asks of the -inl.h files:
// - every function defined outside a class is MPIPE_FUNC (inline in
//   header-only mode), and every variable at namespace scope MPIPE_INLINE_VAR,
//   so that the thread-local scopes, the shared workers and streams, and the
//   counters exist once in the program, whatever the number of files that
//   include mpipe;
// - no anonymous namespaces: a file's helpers live in a namespace named after
//   it (executor_impl, rng_impl, ...), or they would be copied per file.
//   Outside mpipe::detail, code names them qualified (or through a
//   using-directive inside a function), so that header-only mode adds no
//   names to mpipe's public namespaces;
// - the fused CUDA kernels (src/snn/fused_neuron.cu) need nvcc and stay in the
//   compiled library: in header-only mode neurons on CUDA tensors run their
//   ATen path (Note [Fused neurons]); the CPU loop is header code.
#ifdef MPIPE_HEADER_ONLY
#define MPIPE_FUNC inline
#define MPIPE_INLINE_VAR inline
#else
#define MPIPE_FUNC
#define MPIPE_INLINE_VAR
#endif
