# cmake -DDIR=<an example's --out folder> -P check_timeline.cmake
# Checks the files `--timeline DIR/timeline` wrote. Prints "SKIP:" when the
# example did not train (its data set is not installed).
if(NOT EXISTS "${DIR}/mlp_fashion_mnist.pt")
  message("SKIP: the example did not run (no data set?)")
  return()
endif()
file(READ "${DIR}/timeline.json" json)
string(JSON n LENGTH "${json}" traceEvents)
string(JSON method GET "${json}" otherData method)
if(n LESS 10 OR NOT method STREQUAL "train_step")
  message(FATAL_ERROR "timeline.json: ${n} events, method '${method}'")
endif()
file(READ "${DIR}/timeline.svg" svg)
if(NOT svg MATCHES "^<svg" OR NOT svg MATCHES "</svg>\n$")
  message(FATAL_ERROR "timeline.svg is not a complete SVG document")
endif()
message(STATUS "timeline.json: ${n} trace events; timeline.svg complete")
