#pragma once

// The one place the version is written; CMake reads it from here.
/// mpipe's major version.
#define MPIPE_VERSION_MAJOR 0
/// mpipe's minor version.
#define MPIPE_VERSION_MINOR 1
/// mpipe's patch version.
#define MPIPE_VERSION_PATCH 0

#define MPIPE_STRINGIFY_(x) #x
/// `x` after macro expansion, as a string literal.
#define MPIPE_STRINGIFY(x) MPIPE_STRINGIFY_(x)
/// The version as a string literal, "major.minor.patch".
#define MPIPE_VERSION_STRING          \
  MPIPE_STRINGIFY(MPIPE_VERSION_MAJOR) \
  "." MPIPE_STRINGIFY(MPIPE_VERSION_MINOR) "." MPIPE_STRINGIFY(MPIPE_VERSION_PATCH)
