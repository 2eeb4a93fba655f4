/* CRC32C (Castagnoli, reflected 0x82F63B78), which the values' headers record: SSE4.2 on
 * x86-64 where the CPU has it (three streams at once), a table otherwise. */
#include "_pipelines.h"

#include <string.h>

static uint32_t table[256];

static uint32_t crc_table(uint32_t state, const unsigned char *p, size_t n) {
    while (n--) state = table[(state ^ *p++) & 0xff] ^ (state >> 8);
    return state;
}

uint32_t (*crc_update)(uint32_t, const unsigned char *, size_t) = crc_table;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define STREAM 2048 /* bytes per stream of a three-stream step */
/* shift[s][k][v]: the register (v << 8k) after s+1 streams of zeros, for joining streams */
static uint32_t shift[2][4][256];

__attribute__((target("sse4.2"))) static uint32_t zeros(uint32_t state, size_t n) {
    uint64_t s = state;
    for (size_t i = 0; i < n; i += 8) s = _mm_crc32_u64(s, 0);
    return (uint32_t)s;
}

static inline uint32_t shifted(uint32_t (*t)[256], uint32_t x) {
    return t[0][x & 0xff] ^ t[1][(x >> 8) & 0xff] ^ t[2][(x >> 16) & 0xff] ^ t[3][x >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc_sse(uint32_t state, const unsigned char *p, size_t n) {
    uint64_t c0 = state;
    while (n && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        n--;
    }
    /* The register update is linear, so three streams run at once (the instruction's
     * latency is three times its throughput) and are joined: the first two are moved past
     * the bytes after them (a table look-up per register byte) and XORed in. */
    while (n >= 3 * STREAM) {
        uint64_t c1 = 0, c2 = 0, a, b, c;
        for (size_t i = 0; i < STREAM; i += 8) {
            memcpy(&a, p + i, 8);
            memcpy(&b, p + STREAM + i, 8);
            memcpy(&c, p + 2 * STREAM + i, 8);
            c0 = _mm_crc32_u64(c0, a);
            c1 = _mm_crc32_u64(c1, b);
            c2 = _mm_crc32_u64(c2, c);
        }
        c0 = shifted(shift[1], (uint32_t)c0) ^ shifted(shift[0], (uint32_t)c1) ^ (uint32_t)c2;
        p += 3 * STREAM;
        n -= 3 * STREAM;
    }
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t a;
        memcpy(&a, p, 8);
        c0 = _mm_crc32_u64(c0, a);
    }
    while (n--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}

static void init_sse(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return;
    for (int s = 0; s < 2; s++) {
        uint32_t basis[32];
        for (int bit = 0; bit < 32; bit++) basis[bit] = zeros(1u << bit, (size_t)(s + 1) * STREAM);
        for (int k = 0; k < 4; k++)
            for (int v = 0; v < 256; v++) {
                uint32_t x = 0;
                for (int bit = 0; bit < 8; bit++)
                    if (v >> bit & 1) x ^= basis[8 * k + bit];
                shift[s][k][v] = x;
            }
    }
    crc_update = crc_sse;
}
#else
static void init_sse(void) {}
#endif

void init_crc(void) {
    for (uint32_t v = 0; v < 256; v++) {
        uint32_t x = v;
        for (int bit = 0; bit < 8; bit++) x = (x >> 1) ^ (0x82F63B78u & (0u - (x & 1)));
        table[v] = x;
    }
    init_sse();
}

