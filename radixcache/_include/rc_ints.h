/* The compiled core's int64 readers: a Python int read without a call, and a pool's
   range-checked copy of ids */
#ifndef RC_INTS_H
#define RC_INTS_H

#include <Python.h>
#include <stdint.h>
#if PY_VERSION_HEX < 0x030B0000
#include "longintrepr.h"  /* an int's digits (Python.h includes it from 3.11) */
#endif
#include "rc_platform.h"

/* Reads an exact int that fits in int64 without a call; 0 for anything else (a subclass,
   an __index__ object, a value out of range): the caller declines the input. Ints of up
   to 63 bits and their negatives are read from their digits (one pass, no call): on 3.12+
   through the compact-value check, then the digit count and sign of the tag; before,
   from the signed size. Other layouts (15-bit digits) take PyLong_AsLongLongAndOverflow,
   which also runs no Python code for an exact int. */
static inline int rc_digits_int64(const digit* d, Py_ssize_t ndigits, int negative,
                                  int64_t* out) {
#if PyLong_SHIFT == 30
    /* Two digits (ids below 2^60) first; otherwise branch-free past the digit count and
       the sign: ids of mixed signs cost no mispredicted branch. */
    uint64_t mag, top, three, neg;
    if (ndigits == 2) {  /* below 2^60: always fits */
        mag = (uint64_t)d[0] | ((uint64_t)d[1] << 30);
        neg = 0 - (uint64_t)(negative != 0);
        *out = (int64_t)((mag ^ neg) - neg);
        return 1;
    }
    if (ndigits <= 1) {
        mag = ndigits ? (uint64_t)d[0] : 0;
        top = three = 0;
    } else if (ndigits <= 3) {
        top = (uint64_t)d[ndigits - 1];
        three = (uint64_t)(ndigits == 3);
        mag = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((top << 60) & (0 - three));
    } else {
        return 0;  /* 4 digits: at least 2^90 */
    }
    /* 3 digits: 90 bits at most, fits when the top digit is below 2^4 (magnitude below
       2^64); then the sign sets the limit (2^63 - 1, or 2^63 for a negative). */
    if ((three & (uint64_t)((top >> 4) != 0))
            | (uint64_t)(mag > (uint64_t)INT64_MAX + (uint64_t)(negative != 0)))
        return 0;
    neg = 0 - (uint64_t)(negative != 0);
    *out = (int64_t)((mag ^ neg) - neg);
    return 1;
#else
    (void)d; (void)ndigits; (void)negative; (void)out;
    return -1;  /* not handled here */
#endif
}

static inline int rc_read_int(PyObject* o, int64_t* out) {
    int done = -1;
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject*)o)) {
        *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject*)o);
        return 1;
    }
#if defined(_PyLong_NON_SIZE_BITS) && defined(_PyLong_SIGN_MASK)
    {
        uintptr_t tag = ((PyLongObject*)o)->long_value.lv_tag;
        done = rc_digits_int64(((PyLongObject*)o)->long_value.ob_digit,
                               (Py_ssize_t)(tag >> _PyLong_NON_SIZE_BITS),
                               (tag & _PyLong_SIGN_MASK) == 2, out);
    }
#endif
#else
    {
        Py_ssize_t size = Py_SIZE(o);
        done = rc_digits_int64(((PyLongObject*)o)->ob_digit, size < 0 ? -size : size,
                               size < 0, out);
    }
#endif
    if (done >= 0) return done;
    {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow) return 0;
        if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
        *out = (int64_t)v;
        return 1;
    }
}

/* Copies n ids (the two ranges do not overlap) and tells whether one lies outside
   [0, bound), bound >= 0: read as int64, an id v < 0 has the top bit of v set, and one
   with v >= bound >= 0 has v - bound >= 0, whose complement has it set. Subtractions, ors
   and nots only, in eight independent chains: they vectorize on any x86-64 (a 64-bit
   compare does not before SSE4.2). */
static inline int rc_copy_outside(int64_t* RC_RESTRICT out, const int64_t* RC_RESTRICT ids,
                                  Py_ssize_t n, int64_t bound) {
    uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const uint64_t b = (uint64_t)bound;
    uint64_t v;
    Py_ssize_t i = 0, j;
    for (; i + 8 <= n; i += 8) {
        for (j = 0; j < 8; j++) {
            v = (uint64_t)ids[i + j];
            out[i + j] = ids[i + j];
            a[j] |= v | ~(v - b);
        }
    }
    for (; i < n; i++) {
        v = (uint64_t)ids[i];
        out[i] = ids[i];
        a[0] |= v | ~(v - b);
    }
    return (int)((a[0] | a[1] | a[2] | a[3] | a[4] | a[5] | a[6] | a[7]) >> 63);
}

#endif /* RC_INTS_H */
