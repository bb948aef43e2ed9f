#ifndef MPIPE_SPLIT_H_
#define MPIPE_SPLIT_H_

// How a call cuts its batch into micro-batches: by rows per micro-batch (the
// seed's split_size) or by their number (torchgpipe's `chunks`,
// torch.distributed.pipelining's `n_microbatches`).

#include <cstdint>

namespace mpipe {

// Note [Two spellings of a split]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The seed and mpipe take rows per micro-batch (`forward(x, 64)`); torchgpipe
// and torch.distributed.pipelining users think in micro-batch counts. Both
// become one number, the rows per micro-batch, as soon as the batch size is
// known (on the first rank, across processes), so the runtime keeps one
// mechanism: micro-batches of `rows` rows, the last possibly smaller. A count
// n follows torch.chunk, as torchgpipe does: ceil(batch / n) rows each, which
// gives n micro-batches when n divides the batch and may give fewer when it
// does not (10 rows in 4 chunks: 3, 3, 3, 1; 9 rows in 4 chunks: 3, 3, 3).
// A count above the batch gives one row per micro-batch.

/// A batch split into micro-batches. An integer converts to one: rows per
/// micro-batch, as the seed's `split_size`. mpipe::chunks(n) asks for n
/// micro-batches instead (Note [Two spellings of a split]).
class Split {
 public:
  /// Micro-batches of `rows` rows each; the last may be smaller, and a value
  /// at or above the batch gives one micro-batch.
  /* implicit */ Split(int64_t rows) : value_(rows) {}

  /// About `n` micro-batches of ceil(batch / n) rows each (torch.chunk's rule).
  static Split chunks(int64_t n) {
    Split s(n);
    s.by_count_ = true;
    return s;
  }

  /// True for mpipe::chunks(n), false for rows per micro-batch.
  bool by_count() const noexcept { return by_count_; }
  /// The number given: rows per micro-batch, or the micro-batch count.
  int64_t value() const noexcept { return value_; }

 private:
  int64_t value_;
  bool by_count_ = false;
};

/// `n` micro-batches instead of rows per micro-batch:
/// `pipe->forward(x, mpipe::chunks(4))`, `TrainStepOptions(mpipe::chunks(8))`
/// (Note [Two spellings of a split]).
inline Split chunks(int64_t n) { return Split::chunks(n); }

}  // namespace mpipe

#endif  // MPIPE_SPLIT_H_
