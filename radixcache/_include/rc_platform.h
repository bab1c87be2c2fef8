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
