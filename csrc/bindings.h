// Shared pieces of the Python bindings (bindings.cpp, bind_drafting.cpp, bind_goodput.cpp, bind_trees.cpp).
//
// Arrays cross as NumPy arrays or any DLPack producer (torch tensors included); no PyTorch
// headers are used. Kernels with a CUDA backend fill outputs the caller allocated (so device
// memory comes from the caller's allocator); CPU-only kernels return new NumPy arrays.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <string>

namespace vrs_bind {

namespace nb = nanobind;

template <typename Device>
using TokenMatrix = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, Device>;
template <typename Device>
using ConstVector = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, Device>;
template <typename Device, size_t Dims>
using Output = nb::ndarray<int32_t, nb::ndim<Dims>, nb::c_contig, Device>;
template <typename T, size_t Dims>
using NewArray = nb::ndarray<nb::numpy, T, nb::ndim<Dims>, nb::c_contig>;

// A new NumPy array of the given shape, every entry `fill` (call with the GIL held).
template <typename T, size_t Dims>
NewArray<T, Dims> new_array(const std::array<size_t, Dims>& shape, T fill) {
  size_t count = 1;
  for (size_t extent : shape) count *= extent;
  std::unique_ptr<T[]> data(new T[count]);
  std::fill(data.get(), data.get() + count, fill);
  nb::capsule owner(data.get(), [](void* p) noexcept { delete[] static_cast<T*>(p); });
  T* owned_by_capsule = data.release();
  return NewArray<T, Dims>(owned_by_capsule, Dims, shape.data(), owner);
}

// Checks that rows index tokens and that each requested row's length fits the row; returns
// the requested rows' total length (the kernels' work).
int64_t check_rows(const TokenMatrix<nb::device::cpu>& tokens,
                   const ConstVector<nb::device::cpu>& lengths,
                   const ConstVector<nb::device::cpu>& rows);

// Checks that each of a bucket lookup's `count` entries (a match length's or a depth's bucket)
// indexes the table axis it reads, of `axis_size` buckets; `name` and `axis` name both in the error.
void check_bucket_lookup(const int32_t* lookup, size_t count, int64_t axis_size, const std::string& name,
                         const std::string& axis);

void bind_drafting(nb::module_& m);
void bind_trees(nb::module_& m);
void bind_live(nb::module_& m);
void bind_goodput(nb::module_& m);

}  // namespace vrs_bind
