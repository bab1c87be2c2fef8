/* What depends on the compiler or the OS, for both extensions (_core_c, _blocks_c). */
#ifndef RC_PLATFORM_H
#define RC_PLATFORM_H

#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* log2 of a power of two (a child table's size). */
#if defined(__GNUC__) || defined(__clang__)
#define rc_log2(x) ((unsigned)__builtin_ctzll((unsigned long long)(x)))
#else
static inline unsigned rc_log2(unsigned long long x) {
    unsigned n = 0;
    while (x > 1) { x >>= 1; n++; }
    return n;
}
#endif

/* Start reading the memory at p (no-op where the compiler has no builtin). */
#if defined(__GNUC__) || defined(__clang__)
#define rc_prefetch(p) __builtin_prefetch((const void*)(p))
#else
#define rc_prefetch(p) ((void)0)
#endif

/* A 64-bit hash scaled into [0, n): the high word of h * n, so a table of any size takes
   its slot without a division (the hash's high bits must be well mixed). */
#if defined(__SIZEOF_INT128__)
static inline uint64_t rc_fastrange(uint64_t h, uint64_t n) {
    return (uint64_t)(((unsigned __int128)h * n) >> 64);
}
#elif defined(_MSC_VER) && defined(_M_X64)
#include <intrin.h>
static inline uint64_t rc_fastrange(uint64_t h, uint64_t n) { return __umulh(h, n); }
#else
static inline uint64_t rc_fastrange(uint64_t h, uint64_t n) {
    uint64_t h_hi = h >> 32, h_lo = h & 0xFFFFFFFFu, n_hi = n >> 32, n_lo = n & 0xFFFFFFFFu;
    uint64_t mid = h_hi * n_lo + ((h_lo * n_lo) >> 32);
    uint64_t mid2 = h_lo * n_hi + (mid & 0xFFFFFFFFu);
    return h_hi * n_hi + (mid >> 32) + (mid2 >> 32);
}
#endif

/* C99's restrict, as MSVC spells it too. */
#if defined(_MSC_VER)
#define RC_RESTRICT __restrict
#else
#define RC_RESTRICT restrict
#endif

/* Large tables: 2 MiB aligned, advised into transparent huge pages (advice only). */
#if defined(__linux__)
#include <sys/mman.h>
static inline void* rc_huge_alloc(size_t size) {
    void* p = NULL;
    if (posix_memalign(&p, 2097152, size) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, size, MADV_HUGEPAGE);
#endif
    return p;
}
#else
static inline void* rc_huge_alloc(size_t size) { return malloc(size); }
#endif
static inline void rc_huge_free(void* p) { free(p); }

#endif /* RC_PLATFORM_H */
