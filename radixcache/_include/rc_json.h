/* The block module's reader of a JSON array of token ids (json_ids): one pass, no
   allocation, nothing called. */
#ifndef RC_JSON_H
#define RC_JSON_H

#include <Python.h>
#include <stdint.h>

static inline int rc_json_space(unsigned char c) {
    return c == 32 || c == 9 || c == 10 || c == 13;
}

/* The ids of the JSON value at p (size bytes) written to q as int64 little-endian: how
   many, or -1 if the value is not an array of integers in [0, 2**32) written in decimal
   without sign, fraction, exponent or leading zero (JSON whitespace around the brackets,
   commas and ids). q has room for size / 2 + 1 ids (an id and its comma take 2 bytes at
   least). Nothing past p[size - 1] is read. */
static Py_ssize_t rc_json_ids(const unsigned char* p, Py_ssize_t size, int64_t* q) {
    const unsigned char* s = p;
    const unsigned char* end = p + size;
    int64_t* q0 = q;
    /* A value ending in a digit is no array; otherwise an id's digits are read up to the
       first non-digit with no bound check: they end before p[size - 1] at the latest. */
    if (size == 0 || (unsigned)(p[size - 1] - 48) <= 9) return -1;
    while (s < end && rc_json_space(*s)) s++;
    if (s >= end || *s != '[') return -1;
    s++;
    while (s < end && rc_json_space(*s)) s++;
    if (s < end && *s == ']') {
        s++;
    } else {
        for (;;) {
            const unsigned char* first;
            uint64_t v;
            unsigned c;
            if (s >= end) return -1;
            c = (unsigned)(*s - 48);  /* a non-digit wraps past 9 */
            if (c > 9) return -1;
            first = s;
            v = c;
            /* The digits after the first, written out: each is read at a fixed offset (the
               reads do not wait on one another) and no loop's branch back is fetched per
               digit. An 11th digit is refused: 2**32 - 1 has 10. */
#define RC_JSON_DIGIT(i) \
            c = (unsigned)(s[i] - 48); \
            if (c > 9) { s += i; goto id_read; } \
            v = v * 10 + c;
            RC_JSON_DIGIT(1) RC_JSON_DIGIT(2) RC_JSON_DIGIT(3) RC_JSON_DIGIT(4)
            RC_JSON_DIGIT(5) RC_JSON_DIGIT(6) RC_JSON_DIGIT(7) RC_JSON_DIGIT(8)
            RC_JSON_DIGIT(9) RC_JSON_DIGIT(10)
#undef RC_JSON_DIGIT
            return -1;
        id_read:
            /* 2**32 and beyond, or a leading zero */
            if (v >= ((uint64_t)1 << 32) || (*first == '0' && s > first + 1)) return -1;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            *q++ = (int64_t)__builtin_bswap64(v);
#else
            *q++ = (int64_t)v;
#endif
            if (*s == ',') {  /* the usual separators: "," or ", " before the next id */
                s++;
                if (s < end && *s == ' ') s++;
                if (s < end && (unsigned)(*s - 48) <= 9) continue;
            } else {
                while (s < end && rc_json_space(*s)) s++;
                if (s >= end) return -1;
                if (*s == ']') {
                    s++;
                    break;
                }
                if (*s != ',') return -1;
                s++;
            }
            while (s < end && rc_json_space(*s)) s++;
        }
    }
    while (s < end && rc_json_space(*s)) s++;
    return s == end ? (Py_ssize_t)(q - q0) : -1;
}

#endif /* RC_JSON_H */
