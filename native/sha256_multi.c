/* SHA-256 (FIPS 180-4) of several independent streams, interleaved on one core.
 *
 * One SHA-256 stream is bound by the latency of its round chain: with SHA-NI one 64-byte block is 32 dependent
 * sha256rnds2, so a core that can issue one every two cycles sits half idle. Two streams' rounds interleaved in one
 * instruction stream fill that gap: kt_sha256_multi hashes N streams on the calling thread two at a time.
 *
 * The shared lane, kt_sha256_update_shared, pairs streams that different threads hash at the same moment without
 * copying a byte: the first caller runs its own blocks, slice by slice (a "runner"); a caller arriving while a
 * runner is open hands its request to that runner and sleeps until the runner either finished it or gave the rest
 * back (the runner's own blocks ran out first; the caller then runs the rest itself, open to a partner in turn).
 * Nobody ever waits on anything but a runner making progress, and every byte stays in its caller's buffer, which
 * the sleeping caller keeps alive. One stream alone runs the one-stream code between two lock operations per slice.
 *
 * Variants (kt_sha256_impl): KT_SHA256_PORTABLE (plain C, the reference) and KT_SHA256_SHANI (x86 SHA extensions:
 * one stream, or two interleaved), chosen once by CPU feature ("sha" in kt_cpu_features; KTCONVERT_FORCE_IMPL=scalar
 * and KTCONVERT_DISABLE_CPU_FEATURES=sha select the portable code). States are the eight 32-bit words H0..H7 in
 * native order; padding and the final digest bytes come from kt_sha256_finish. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "kt_internal.h"

#ifdef KT_X86
#include <immintrin.h>
#endif

#define KT_SHA256_AUTO 0
#define KT_SHA256_PORTABLE 1
#define KT_SHA256_SHANI 2

#define SLICE_BLOCKS 1024        /* blocks a runner hashes between two looks at its partner (64 KiB, ~45 us) */
#define SHARED_MIN_BLOCKS 64     /* shorter updates are hashed at once, never through the lane */
#define MULTI_MAX_STREAMS 4096   /* streams one kt_sha256_multi call takes */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H256_INIT[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                      0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

/* ---------------------------------------------------------------- portable C */

static inline uint32_t ror32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void blocks_portable(uint32_t *state, const uint8_t *data, int64_t nblocks) {
    for (int64_t blk = 0; blk < nblocks; blk++, data += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)data[4 * t] << 24 | (uint32_t)data[4 * t + 1] << 16 | (uint32_t)data[4 * t + 2] << 8 |
                   data[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ror32(w[t - 15], 7) ^ ror32(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ror32(w[t - 2], 17) ^ ror32(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
            uint32_t t2 = (ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        state[0] += a, state[1] += b, state[2] += c, state[3] += d;
        state[4] += e, state[5] += f, state[6] += g, state[7] += h;
    }
}

/* ---------------------------------------------------------------- SHA-NI */

#ifdef KT_X86
#define SHANI __attribute__((target("sha,sse4.1,ssse3")))

/* X0 <- the next four message words from the previous sixteen (X0 oldest, X3 newest). */
#define SCHEDULE(X0, X1, X2, X3) \
    X0 = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32(X0, X1), _mm_alignr_epi8(X3, X2, 4)), X3)

/* Four rounds on message words X (group j of 16). S0 = ABEF, S1 = CDGH. */
#define ROUNDS4(S0, S1, X, j)                                                                 \
    do {                                                                                      \
        __m128i wk_ = _mm_add_epi32(X, _mm_loadu_si128((const __m128i *)&K256[4 * (j)]));      \
        S1 = _mm_sha256rnds2_epu32(S1, S0, wk_);                                              \
        S0 = _mm_sha256rnds2_epu32(S0, S1, _mm_shuffle_epi32(wk_, 0x0E));                     \
    } while (0)

/* H0..H7 -> the (ABEF, CDGH) register pair sha256rnds2 works on, and back. */
SHANI static inline void shani_load(const uint32_t *state, __m128i *abef, __m128i *cdgh) {
    __m128i abcd = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)state), 0xB1);       /* CDAB */
    __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)(state + 4)), 0x1B); /* EFGH */
    *abef = _mm_alignr_epi8(abcd, efgh, 8);
    *cdgh = _mm_blend_epi16(efgh, abcd, 0xF0);
}

SHANI static inline void shani_store(uint32_t *state, __m128i abef, __m128i cdgh) {
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
    __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)state, _mm_blend_epi16(feba, dchg, 0xF0));
    _mm_storeu_si128((__m128i *)(state + 4), _mm_alignr_epi8(dchg, feba, 8));
}

#define BSWAP_MASK() _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL)
#define LOAD_MSG(p, i, mask) _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p) + (i)), mask)

SHANI static void blocks_shani(uint32_t *state, const uint8_t *data, int64_t nblocks) {
    const __m128i mask = BSWAP_MASK();
    __m128i s0, s1;
    shani_load(state, &s0, &s1);
    for (int64_t blk = 0; blk < nblocks; blk++, data += 64) {
        __m128i save0 = s0, save1 = s1;
        __m128i x0 = LOAD_MSG(data, 0, mask), x1 = LOAD_MSG(data, 1, mask);
        __m128i x2 = LOAD_MSG(data, 2, mask), x3 = LOAD_MSG(data, 3, mask);
        ROUNDS4(s0, s1, x0, 0);
        ROUNDS4(s0, s1, x1, 1);
        ROUNDS4(s0, s1, x2, 2);
        ROUNDS4(s0, s1, x3, 3);
        for (int j = 4; j < 16; j += 4) {
            SCHEDULE(x0, x1, x2, x3);
            ROUNDS4(s0, s1, x0, j);
            SCHEDULE(x1, x2, x3, x0);
            ROUNDS4(s0, s1, x1, j + 1);
            SCHEDULE(x2, x3, x0, x1);
            ROUNDS4(s0, s1, x2, j + 2);
            SCHEDULE(x3, x0, x1, x2);
            ROUNDS4(s0, s1, x3, j + 3);
        }
        s0 = _mm_add_epi32(s0, save0);
        s1 = _mm_add_epi32(s1, save1);
    }
    shani_store(state, s0, s1);
}

/* Two streams, `nblocks` blocks each, their instructions interleaved so the two round chains overlap (written over
 * arrays that the compiler unrolls into registers; measured on Zen 3: 1.87x one stream, where a third stream adds 2%
 * more). */
SHANI static void blocks_shani_x2(uint32_t *state_a, const uint8_t *a, uint32_t *state_b, const uint8_t *b,
                                  int64_t nblocks) {
    const __m128i mask = BSWAP_MASK();
    const uint8_t *data[2] = {a, b};
    __m128i s0[2], s1[2], save0[2], save1[2], x[2][4];
    shani_load(state_a, &s0[0], &s1[0]);
    shani_load(state_b, &s0[1], &s1[1]);
    for (int64_t blk = 0; blk < nblocks; blk++) {
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            save0[i] = s0[i];
            save1[i] = s1[i];
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
#pragma GCC unroll 2
            for (int i = 0; i < 2; i++) {
                x[i][j] = LOAD_MSG(data[i] + 64 * blk, j, mask);
                ROUNDS4(s0[i], s1[i], x[i][j], j);
            }
#pragma GCC unroll 12
        for (int j = 4; j < 16; j++)
#pragma GCC unroll 2
            for (int i = 0; i < 2; i++) {
                SCHEDULE(x[i][j % 4], x[i][(j + 1) % 4], x[i][(j + 2) % 4], x[i][(j + 3) % 4]);
                ROUNDS4(s0[i], s1[i], x[i][j % 4], j);
            }
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            s0[i] = _mm_add_epi32(s0[i], save0[i]);
            s1[i] = _mm_add_epi32(s1[i], save1[i]);
        }
    }
    shani_store(state_a, s0[0], s1[0]);
    shani_store(state_b, s0[1], s1[1]);
}
#endif

/* ---------------------------------------------------------------- choosing the variant */

/* KT_SHA256_SHANI where the CPU has it and KTCONVERT_FORCE_IMPL is not "scalar", else KT_SHA256_PORTABLE; an
 * explicit variant: itself when it can run here, else -KT_E_IMPL (-KT_E_ARG when unknown). */
KT_API int kt_sha256_impl(int requested) {
    int have_shani = 0;
#ifdef KT_X86
    have_shani = (kt_cpu_features() & KT_CPU_SHA) != 0;
#endif
    if (requested == KT_SHA256_AUTO) {
        if (kt_select_impl() == KT_IMPL_SCALAR) return KT_SHA256_PORTABLE;
        return have_shani ? KT_SHA256_SHANI : KT_SHA256_PORTABLE;
    }
    if (requested == KT_SHA256_PORTABLE) return requested;
    if (requested == KT_SHA256_SHANI) return have_shani ? requested : -KT_E_IMPL;
    return -KT_E_ARG;
}

KT_API const char *kt_sha256_impl_name(int impl) {
    switch (impl) {
    case KT_SHA256_PORTABLE: return "portable";
    case KT_SHA256_SHANI: return "sha-ni";
    default: return NULL;
    }
}

static void blocks_one(int impl, uint32_t *state, const uint8_t *data, int64_t nblocks) {
#ifdef KT_X86
    if (impl == KT_SHA256_SHANI) {
        blocks_shani(state, data, nblocks);
        return;
    }
#endif
    (void)impl;
    blocks_portable(state, data, nblocks);
}

static void blocks_two(int impl, uint32_t *state_a, const uint8_t *a, uint32_t *state_b, const uint8_t *b,
                       int64_t nblocks) {
#ifdef KT_X86
    if (impl == KT_SHA256_SHANI) {
        blocks_shani_x2(state_a, a, state_b, b, nblocks);
        return;
    }
#endif
    blocks_one(impl, state_a, a, nblocks);
    blocks_one(impl, state_b, b, nblocks);
}

/* ---------------------------------------------------------------- one thread: one stream or many */

KT_API void kt_sha256_init(uint32_t *state) { memcpy(state, H256_INIT, sizeof H256_INIT); }

/* state <- state updated by `nblocks` whole 64-byte blocks at `data`. KT_OK, or KT_E_IMPL / KT_E_ARG. */
KT_API int kt_sha256_blocks(uint32_t *state, const uint8_t *data, int64_t nblocks, int impl) {
    int chosen = kt_sha256_impl(impl);
    if (chosen < 0) return -chosen;
    if (nblocks < 0 || (nblocks > 0 && (state == NULL || data == NULL))) return KT_E_ARG;
    blocks_one(chosen, state, data, nblocks);
    return KT_OK;
}

/* n streams at once on this thread: states[i] updated by nblocks[i] blocks at data[i], two streams interleaved at a
 * time (the two with the most blocks left, so the pairs last as long as they can). */
KT_API int kt_sha256_multi(int n, uint32_t *const *states, const uint8_t *const *data, const int64_t *nblocks,
                           int impl) {
    int chosen = kt_sha256_impl(impl);
    if (chosen < 0) return -chosen;
    if (n < 0 || n > MULTI_MAX_STREAMS || (n > 0 && (states == NULL || data == NULL || nblocks == NULL)))
        return KT_E_ARG;
    for (int i = 0; i < n; i++)
        if (nblocks[i] < 0 || (nblocks[i] > 0 && (states[i] == NULL || data[i] == NULL))) return KT_E_ARG;
    int64_t done[n > 0 ? n : 1];
    memset(done, 0, sizeof done);
    for (;;) {
        int first = -1, second = -1;
        for (int i = 0; i < n; i++) {
            int64_t left = nblocks[i] - done[i];
            if (left <= 0) continue;
            if (first < 0 || left > nblocks[first] - done[first]) {
                second = first;
                first = i;
            } else if (second < 0 || left > nblocks[second] - done[second]) {
                second = i;
            }
        }
        if (first < 0) return KT_OK;
        if (second < 0) {
            blocks_one(chosen, states[first], data[first] + 64 * done[first], nblocks[first] - done[first]);
            done[first] = nblocks[first];
            continue;
        }
        int64_t run = nblocks[second] - done[second];   /* the shorter of the two */
        blocks_two(chosen, states[first], data[first] + 64 * done[first], states[second],
                   data[second] + 64 * done[second], run);
        done[first] += run;
        done[second] += run;
    }
}

/* ---------------------------------------------------------------- the shared lane: pairing threads' streams */

typedef struct sha_request {
    uint32_t *state;
    const uint8_t *data;
    int64_t left;               /* blocks still to hash */
    int returned;               /* set by the runner holding it as a partner: done, or the rest is the caller's */
    pthread_cond_t wake;
} sha_request;

typedef struct sha_runner {
    sha_request *own;
    sha_request *partner;       /* NULL, or a request another thread handed over */
    struct sha_runner *next;    /* in the list of runners open to a partner */
} sha_runner;

static pthread_mutex_t lane_mutex = PTHREAD_MUTEX_INITIALIZER;
static sha_runner *open_runners;     /* runners without a partner that will run at least one more slice */

static void unlist_runner(sha_runner *runner) {
    for (sha_runner **p = &open_runners; *p; p = &(*p)->next)
        if (*p == runner) {
            *p = runner->next;
            return;
        }
}

static void give_back(sha_request *partner) {
    partner->returned = 1;
    pthread_cond_signal(&partner->wake);
}

/* Hash `req` on this thread, taking in one partner at a time; the lane mutex is held on entry and on return. */
static void run_request(int impl, sha_request *req) {
    sha_runner self = {req, NULL, NULL};
    if (req->left > SLICE_BLOCKS) {
        self.next = open_runners;
        open_runners = &self;
    }
    while (req->left > 0) {
        sha_request *partner = self.partner;
        int64_t run = req->left < SLICE_BLOCKS ? req->left : SLICE_BLOCKS;
        if (partner != NULL && partner->left < run) run = partner->left;
        pthread_mutex_unlock(&lane_mutex);
        if (partner != NULL)
            blocks_two(impl, req->state, req->data, partner->state, partner->data, run);
        else
            blocks_one(impl, req->state, req->data, run);
        pthread_mutex_lock(&lane_mutex);
        req->data += 64 * run;
        req->left -= run;
        if (partner != NULL) {
            partner->data += 64 * run;
            partner->left -= run;
            if (partner->left == 0) {
                self.partner = NULL;
                give_back(partner);
            }
        }
        int open = self.partner == NULL && req->left > SLICE_BLOCKS;   /* no partner joins for a last slice */
        unlist_runner(&self);
        if (open) {
            self.next = open_runners;
            open_runners = &self;
        }
    }
    unlist_runner(&self);
    if (self.partner != NULL) give_back(self.partner);  /* its rest: the caller runs it */
}

/* As kt_sha256_blocks, from any thread; several threads hashing at the same time are paired (see the top). Safe for
 * distinct states; one state must not be updated by two threads at once. */
KT_API int kt_sha256_update_shared(uint32_t *state, const uint8_t *data, int64_t nblocks, int impl) {
    int chosen = kt_sha256_impl(impl);
    if (chosen < 0) return -chosen;
    if (nblocks < 0 || (nblocks > 0 && (state == NULL || data == NULL))) return KT_E_ARG;
    if (chosen != KT_SHA256_SHANI || nblocks < SHARED_MIN_BLOCKS) {
        blocks_one(chosen, state, data, nblocks);
        return KT_OK;
    }
    sha_request req = {state, data, nblocks, 0, PTHREAD_COND_INITIALIZER};
    pthread_mutex_lock(&lane_mutex);
    while (req.left > 0) {
        sha_runner *host = open_runners;
        if (host == NULL) {
            run_request(chosen, &req);
            break;
        }
        open_runners = host->next;       /* one partner per runner */
        host->partner = &req;
        req.returned = 0;
        while (!req.returned) pthread_cond_wait(&req.wake, &lane_mutex);
    }
    pthread_mutex_unlock(&lane_mutex);
    pthread_cond_destroy(&req.wake);
    return KT_OK;
}

/* The digest of a stream: `state` after all its whole blocks, the `tail_len` (< 64) bytes after them, the stream's
 * length in bytes `total_len`. `state` is left as it was. */
KT_API int kt_sha256_finish(const uint32_t *state, const uint8_t *tail, int64_t tail_len, uint64_t total_len,
                            uint8_t *digest, int impl) {
    int chosen = kt_sha256_impl(impl);
    if (chosen < 0) return -chosen;
    if (state == NULL || digest == NULL || tail_len < 0 || tail_len >= 64 || (tail_len > 0 && tail == NULL))
        return KT_E_ARG;
    uint8_t last[128] = {0};
    uint32_t h[8];
    memcpy(h, state, sizeof h);
    if (tail_len) memcpy(last, tail, (size_t)tail_len);
    last[tail_len] = 0x80;
    int64_t nblocks = tail_len < 56 ? 1 : 2;
    uint64_t bits = total_len << 3;
    for (int i = 0; i < 8; i++) last[64 * nblocks - 1 - i] = (uint8_t)(bits >> (8 * i));
    blocks_one(chosen, h, last, nblocks);
    for (int i = 0; i < 8; i++) {
        digest[4 * i] = (uint8_t)(h[i] >> 24);
        digest[4 * i + 1] = (uint8_t)(h[i] >> 16);
        digest[4 * i + 2] = (uint8_t)(h[i] >> 8);
        digest[4 * i + 3] = (uint8_t)h[i];
    }
    return KT_OK;
}
