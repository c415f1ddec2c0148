// Reading and writing float matrices for the softkv command-line client: NumPy .npy and .fvecs.
#pragma once

#include <cstddef>
#include <filesystem>
#include <vector>

namespace softkv::cli {

/// A row-major float matrix.
struct Matrix {
  std::size_t rows = 0;       ///< number of vectors
  std::size_t cols = 0;       ///< floats per vector
  std::vector<float> data;    ///< rows x cols
};

/// Reads a little-endian float32 C-order .npy (1-D: one row) or an .fvecs file (by extension);
/// throws Error(invalid_argument) naming the problem for anything else.
Matrix read_matrix(const std::filesystem::path& path);

/// Writes m as a float32 .npy file (shape rows x cols).
void write_npy(const std::filesystem::path& path, const Matrix& m);

}  // namespace softkv::cli
