// No include guard: every public mpipe header that has an implementation
// includes this check first. In header-only mode only mpipe/mpipe.h pulls the
// implementation (Note [Header-only mode] in mpipe/detail/config.h), so a
// file must include it before any other mpipe header.

#if defined(MPIPE_HEADER_ONLY) && !defined(MPIPE_MPIPE_H_)
#error "mpipe header-only mode (mpipe::mpipe_header_only): include <mpipe/mpipe.h> first; it pulls the implementation, which the other headers do not"
#endif
