#pragma once

// Note [Header-only mode]
// ~~~~~~~~~~~~~~~~~~~~~~~
// mpipe's implementation lives in include/mpipe/detail/<layer>/*-inl.h, in the
// way of fmt's format-inl.h. By default (the target mpipe::mpipe) the files in
// src/, one per subsystem, compile those files once into libmpipe, and the
// public headers never include them, so a program's own files parse only the
// declarations. One switch, MPIPE_HEADER_ONLY (the target
// mpipe::mpipe_header_only), compiles them into the program's files instead,
// and the program links LibTorch alone. As with fmt, only the umbrella header
// pulls the implementation: mpipe/mpipe.h ends with every -inl.h file
// (mpipe/detail/implementation.h) in that mode, so a file includes it before
// any other mpipe header; the others include only what they declare, and
// each one with an implementation starts with a check
// (mpipe/detail/header_only.h) that refuses, at compile time, a file that
// did not.
//
// What that asks of the -inl.h files:
// - every function defined outside a class is MPIPE_FUNC (inline in
//   header-only mode), and every variable at namespace scope MPIPE_INLINE_VAR,
//   so that the thread-local scopes, the shared workers and streams, and the
//   counters exist once in the program, whatever the number of files that
//   include mpipe;
// - no anonymous namespaces: helpers live in mpipe::detail (public headers
//   open no nested detail namespace, such as mpipe::snn::detail), where one
//   file's names meet every other file's: both modes compile several -inl.h
//   files together, so a clash fails the build;
// - the fused CUDA kernels (src/fused_neuron.cu) need nvcc and stay in the
//   compiled library: in header-only mode neurons on CUDA tensors run their
//   ATen path (Note [Fused neurons]); the CPU loop is header code.
#ifdef MPIPE_HEADER_ONLY
#define MPIPE_FUNC inline
#define MPIPE_INLINE_VAR inline
#else
#define MPIPE_FUNC
#define MPIPE_INLINE_VAR
#endif
