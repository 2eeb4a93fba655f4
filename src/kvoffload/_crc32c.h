/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the ``crc32c`` package's values,
 * for the C extensions that check block payloads (kvoffload.tiers.fs._runread,
 * kvoffload.tiers.redis._pipelines). Each includes this file and gets its own copy.
 *
 *   crc32c_fn crc32c_init(void)   fills the tables; returns the fastest implementation this
 *                                 CPU runs: SSE4.2 on x86-64 CPUs that have it (three
 *                                 streams at once), a byte table otherwise
 *   f(state, p, n)                the register ``state`` moved past ``n`` bytes at ``p``
 *                                 (start at 0xFFFFFFFF, the CRC is the final one inverted)
 */
#ifndef KVOFFLOAD_CRC32C_H
#define KVOFFLOAD_CRC32C_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef uint32_t (*crc32c_fn)(uint32_t, const unsigned char *, size_t);

static uint32_t crc32c_table[256];

static uint32_t crc32c_bytes(uint32_t state, const unsigned char *p, size_t n) {
    while (n--) state = crc32c_table[(state ^ *p++) & 0xff] ^ (state >> 8);
    return state;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define CRC32C_STREAM 2048 /* bytes per stream of a three-stream step */
/* crc32c_shift[s][k][v]: the register (v << 8k) after s+1 streams of zeros, for joining */
static uint32_t crc32c_shift[2][4][256];

__attribute__((target("sse4.2"))) static uint32_t crc32c_zeros(uint32_t state, size_t n) {
    uint64_t s = state;
    for (size_t i = 0; i < n; i += 8) s = _mm_crc32_u64(s, 0);
    return (uint32_t)s;
}

static inline uint32_t crc32c_shifted(uint32_t (*t)[256], uint32_t x) {
    return t[0][x & 0xff] ^ t[1][(x >> 8) & 0xff] ^ t[2][(x >> 16) & 0xff] ^ t[3][x >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse(uint32_t state, const unsigned char *p, size_t n) {
    uint64_t c0 = state;
    while (n && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        n--;
    }
    /* The register update is linear, so three streams run at once (the instruction's
     * latency is three times its throughput) and are joined: the first two are moved past
     * the bytes after them (a table look-up per register byte) and XORed in. */
    while (n >= 3 * CRC32C_STREAM) {
        uint64_t c1 = 0, c2 = 0, a, b, c;
        for (size_t i = 0; i < CRC32C_STREAM; i += 8) {
            memcpy(&a, p + i, 8);
            memcpy(&b, p + CRC32C_STREAM + i, 8);
            memcpy(&c, p + 2 * CRC32C_STREAM + i, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
        }
        c0 = crc32c_shifted(crc32c_shift[1], (uint32_t)c0) ^ crc32c_shifted(crc32c_shift[0], (uint32_t)c1) ^
             (uint32_t)c2;
        p += 3 * CRC32C_STREAM;
        n -= 3 * CRC32C_STREAM;
    }
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c0 = _mm_crc32_u64(c0, a);
    }
    while (n--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}

static crc32c_fn crc32c_init_sse(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return crc32c_bytes;
    for (int s = 0; s < 2; s++) {
        uint32_t basis[32];
        for (int bit = 0; bit < 32; bit++) basis[bit] = crc32c_zeros(1u << bit, (size_t)(s + 1) * CRC32C_STREAM);
        for (int k = 0; k < 4; k++)
            for (int v = 0; v < 256; v++) {
                uint32_t x = 0;
                for (int bit = 0; bit < 8; bit++)
                    if (v >> bit & 1) x ^= basis[8 * k + bit];
                crc32c_shift[s][k][v] = x;
            }
    }
    return crc32c_sse;
}
#else
static crc32c_fn crc32c_init_sse(void) { return crc32c_bytes; }
#endif

static crc32c_fn crc32c_init(void) {
    for (uint32_t v = 0; v < 256; v++) {
        uint32_t x = v;
        for (int bit = 0; bit < 8; bit++) x = (x >> 1) ^ (0x82F63B78u & (0u - (x & 1)));
        crc32c_table[v] = x;
    }
    return crc32c_init_sse();
}

#endif
