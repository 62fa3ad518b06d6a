// What the benchmarks' C++ harnesses (records_phases.cpp, q4c_walk.cpp) share: a buffer on 2 MiB
// pages, as the product keeps its records and q4c copies (`kernels.huge_empty`), and a float
// written as the f16 the kernel reads.
#pragma once
#include <immintrin.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

// bytes rounded up to whole 2 MiB pages
inline size_t whole_huge_pages(size_t bytes) {
  return (bytes + (1 << 21) - 1) & ~((size_t)(1 << 21) - 1);
}

// A 2 MiB-aligned buffer of whole_huge_pages(bytes), on 2 MiB pages where Linux's transparent
// huge pages allow (madvise, before any touch); with -DSMALL_PAGES on 4 KiB pages
inline uint8_t* huge_buffer(size_t bytes) {
  bytes = whole_huge_pages(bytes);
  uint8_t* p = (uint8_t*)std::aligned_alloc(1 << 21, bytes);
#ifndef SMALL_PAGES
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

inline void put_half(uint8_t* p, float v) {
  const uint16_t h = _cvtss_sh(v, 0);
  std::memcpy(p, &h, 2);
}
