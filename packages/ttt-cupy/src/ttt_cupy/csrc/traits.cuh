// Tile sizes and shared memory per (D_PAD, BT): the one source of the kernels' layout.
// ttt_cupy/_traits_table.py is generated from it (tools/gen_traits_table.py).
#pragma once

namespace ttt {

// fwd_decode (no chunk size): kThreads threads holding kEntries entries each of the state in
// registers, a column's rows in kParts parts (consecutive lanes), read kVec at a time from
// shared memory; kRowBytes per row of the longest sequence (k, q, v, kh / g, q W [D_PAD] fp32
// each, eta, eta_key)
template <int D_PAD>
struct DecodeTraits {
    static constexpr int kThreads = D_PAD >= 128 ? 256 : 128;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kParts = kThreads / D_PAD;      // 8, 4, 2, 2 at D_PAD 16 .. 128
    static constexpr int kEntries = D_PAD / kParts;      // 2, 8, 32, 64
    static constexpr int kVec = kEntries < 4 ? kEntries : 4;
    static constexpr int kRowFloats = 5 * D_PAD + 2;
    static constexpr unsigned long long kRowBytes = 4ull * kRowFloats;
    static_assert(kParts * D_PAD == kThreads && 32 % kParts == 0, "a column's lanes in a warp");
    static_assert(kEntries % kVec == 0, "whole shared-memory vectors");
};

template <int D_PAD, int BT>
struct Traits {
    static_assert(D_PAD == 16 || D_PAD == 32 || D_PAD == 64 || D_PAD == 128,
                  "D_PAD must be 16, 32, 64 or 128");
    static_assert(BT == 16 || BT == 32 || BT == 64, "BT must be 16, 32 or 64");
    static constexpr int kThreads = D_PAD >= 64 ? 256 : 128;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kPerLane = (D_PAD + 31) / 32;  // row elements per lane in row passes
    static constexpr int kRowsPerWarp = BT / kWarps;     // rows of a chunk per warp
    static constexpr int kLd = D_PAD + 1;                // row stride of [BT, D_PAD] tiles and
                                                         // of [D_PAD, D_PAD] states
    static constexpr int kLdA = BT + 1;                  // row stride of [BT, BT] tiles
    static constexpr int kTile = BT * kLd;
    static constexpr int kState = D_PAD * kLd;
    static constexpr int kSquare = BT * kLdA;
    // shared memory (floats) of each kernel
    // fwd_chain: W, hb, K, G
    static constexpr int kFwdChainFloats = kState + D_PAD + 2 * kTile;
    // fwd_out:   W, hb, Q, K, G, A, eta
    static constexpr int kFwdOutFloats = kState + D_PAD + 3 * kTile + kSquare + BT;
    // bwd_local: W, hb, Q, K, DO, G, A, dS/dP, eta
    static constexpr int kBwdLocalFloats = kState + D_PAD + 4 * kTile + 2 * kSquare + BT;
    // bwd_chain: dW, dhb, Q, K, DOP, DKH, row sums
    static constexpr int kBwdChainFloats = kState + D_PAD + 4 * kTile + BT;
    // bwd_grads: W, dW, Q, K, DOP, G, DKH, S, eta. At D_PAD 128 with BT 64 (307 KiB whole)
    // kGradsSplit = 2 blocks share a (group, head), each with kGradsRows rows of W and dW
    // ([kGradsRows, D_PAD + 1]) and those columns of q and k ([BT, kGradsRows + 1])
    static constexpr int kGradsSplit = (D_PAD == 128 && BT == 64) ? 2 : 1;
    static constexpr int kGradsRows = D_PAD / kGradsSplit;
    static constexpr int kLdH = kGradsRows + 1;          // row stride of the [BT, kGradsRows] tiles
    static constexpr int kBwdGradsBaseFloats =
        2 * kGradsRows * kLd + 2 * BT * kLdH + 3 * kTile + kSquare + BT;
    // the chains' MMA instances: a warp per 16 state columns; fwd_chain's: K, V
    // double-buffered, row statistics
    static constexpr int kTcWarps = D_PAD / 16;
    static constexpr int kTcThreads = 32 * kTcWarps;
    static constexpr int kFwdChainTcFloats = 4 * kTile + 4 * kTcWarps * BT;
    static constexpr unsigned long long kFwdChainTcBytes = 4ull * kFwdChainTcFloats;
    // bwd_chain's MMA instance: Q, K double-buffered, three rounds of 4 row sums per warp
    static constexpr int kBwdChainTcFloats = 4 * kTile + 12 * kTcWarps * BT;
    // ... and the previous chunk's xh, do_pre, dg, v, q, k, r staged by cp.async (StagedRows),
    // [BT, D_PAD + 4] floats each, where the block stays within kStageLimit (an A100's
    // 163 KiB: staging takes no shape off a GPU)
    static constexpr unsigned long long kStageLimit = 163ull * 1024;
    static constexpr int kStageTile = BT * (D_PAD + 4);
    static constexpr int kBwdChainStageFloats = 6 * kStageTile + BT;
    static constexpr bool kBwdChainStage =
        4ull * (kBwdChainTcFloats + kBwdChainStageFloats) <= kStageLimit;
    static constexpr unsigned long long kBwdChainTcBytes =
        4ull * (kBwdChainTcFloats + (kBwdChainStage ? kBwdChainStageFloats : 0));
    // bwd_chain's fused instance (D_PAD <= 64): then g, dkh, do_pre, dW, W, S, eta
    static constexpr int kBwdChainFusedFloats = 3 * kTile + 2 * kState + kSquare + BT;
    static constexpr unsigned long long kBwdChainFusedTcBytes =
        kBwdChainTcBytes + 4ull * kBwdChainFusedFloats;
    // bwd_grads stages the next chunk's do_pre ([BT, D_PAD + 4] floats, 16-byte aligned) and
    // eta by cp.async under the same rule (kGradsSplit 1 only)
    static constexpr int kGradsStageOffset = (kBwdGradsBaseFloats + 3) / 4 * 4;
    static constexpr int kGradsStageFloats =
        kGradsStageOffset - kBwdGradsBaseFloats + kStageTile + BT;
    static constexpr bool kGradsStage =
        kGradsSplit == 1 && 4ull * (kBwdGradsBaseFloats + kGradsStageFloats) <= kStageLimit;
    static constexpr int kBwdGradsFloats =
        kBwdGradsBaseFloats + (kGradsStage ? kGradsStageFloats : 0);
    // fwd_chain's FUSE instances. SIMT: fwd_out's tiles. MMA: the unfused ones, then Q and
    // eta double-buffered, A, per-warp statistics of o_pre's rows
    static constexpr int kFwdChainFusedFloats = kFwdOutFloats;
    static constexpr int kFwdChainFusedTcFloats =
        kFwdChainTcFloats + 2 * kTile + kSquare + 2 * BT + 2 * kTcWarps * BT;
    // blocks per SM asked of ptxas for the fused forward chain's MMA instance at D_PAD 64,
    // chunk 16: 512 chains in one wave of 132 SMs x 4 (128 registers a thread)
    static constexpr int kFusedChainBlocks = D_PAD == 64 && BT == 16 ? 4 : 1;
    // bwd_grads' blocks per SM asked of ptxas at D_PAD 64, chunk 16 (at most 85 registers)
    static constexpr int kGradsBlocks = D_PAD == 64 && BT == 16 ? 3 : 1;
    // fwd_out's and bwd_local's MMA instances walk a group in blocks of kOutRows rows (one
    // masked product per block): fwd_out holds W, hb, Q, K, G, M, eta
    static constexpr int kOutRows = D_PAD <= 32 ? 64 : (D_PAD == 64 && BT < 32 ? 32 : BT);
    static constexpr int kFwdOutTcBaseFloats =
        kState + D_PAD + 3 * kOutRows * kLd + kOutRows * (kOutRows + 1) + kOutRows;
    // ... and stages the next block by cp.async (kOutStage: still 3 blocks per H200 SM): from a
    // 16-byte aligned offset q, k, v as [kOutRows, D_PAD + 16 / TS] elements of TS bytes, xh
    // [kOutRows, D_PAD + 4] floats, r, eta. Half inputs: TS = 2 (the CPU emulation's: 4)
    static constexpr bool kOutStage = D_PAD <= 64 && D_PAD * kOutRows <= 2048;
    static constexpr int kOutStageOffset = (kFwdOutTcBaseFloats + 3) / 4 * 4;
    template <int TS>
    static constexpr int kOutStageRaw = kOutRows * (D_PAD + 16 / TS) * TS / 4;
    template <int TS>
    static constexpr int kFwdOutTcFloatsT =
        kOutStage ? kOutStageOffset + 3 * kOutStageRaw<TS> + kOutRows * (D_PAD + 4) + 2 * kOutRows
                  : kFwdOutTcBaseFloats;
    static constexpr unsigned long long kFwdOutTcBytes = 4ull * kFwdOutTcFloatsT<2>;
    // fwd_out's MMA blocks per SM asked of ptxas at D_PAD 64, chunk 16: as many as fit an H200 SM
    static constexpr int kOutBlocks = D_PAD == 64 && BT == 16 ? (kOutStage ? 3 : 4) : 1;
    // bwd_local's MMA instance likewise: W, hb, Q, K, DO, G, A, M / dS / dP', eta
    static constexpr int kBwdLocalTcBaseFloats =
        kState + D_PAD + 4 * kOutRows * kLd + 2 * kOutRows * (kOutRows + 1) + kOutRows;
    // ... and stages the next block's q, k, do ([kOutRows, D_PAD + 4] floats each, 16-byte
    // aligned) and eta by cp.async at D_PAD <= 64 within kStageLimit
    static constexpr int kLocalStageOffset = (kBwdLocalTcBaseFloats + 3) / 4 * 4;
    static constexpr int kLocalStageFloats =
        kLocalStageOffset - kBwdLocalTcBaseFloats + 3 * kOutRows * (D_PAD + 4) + kOutRows;
    static constexpr bool kLocalStage =
        D_PAD <= 64 && 4ull * (kBwdLocalTcBaseFloats + kLocalStageFloats) <= kStageLimit;
    // ... and at D_PAD 64 the g row pass's xh, v ([kOutRows, D_PAD + 4] floats each) and r
    static constexpr bool kLocalStageSaved = kLocalStage && D_PAD == 64;
    static constexpr int kLocalStageSavedFloats = 2 * kOutRows * (D_PAD + 4) + kOutRows;
    static constexpr int kBwdLocalTcFloats =
        kBwdLocalTcBaseFloats + (kLocalStage ? kLocalStageFloats : 0) +
        (kLocalStageSaved ? kLocalStageSavedFloats : 0);
    static constexpr unsigned long long kBwdLocalTcBytes = 4ull * kBwdLocalTcFloats;
    static constexpr unsigned long long kFwdChainFusedBytes = 4ull * kFwdChainFusedFloats;
    static constexpr unsigned long long kFwdChainFusedTcBytes = 4ull * kFwdChainFusedTcFloats;
    static constexpr unsigned long long kFwdChainBytes = 4ull * kFwdChainFloats;
    static constexpr unsigned long long kFwdOutBytes = 4ull * kFwdOutFloats;
    static constexpr unsigned long long kBwdLocalBytes = 4ull * kBwdLocalFloats;
    static constexpr unsigned long long kBwdChainBytes = 4ull * kBwdChainFloats;
    static constexpr unsigned long long kBwdGradsBytes = 4ull * kBwdGradsFloats;
    // fwd_decode's (DecodeTraits; the same at every BT), for the launcher's table
    static constexpr int kDecThreads = DecodeTraits<D_PAD>::kThreads;
    static constexpr unsigned long long kDecRowBytes = DecodeTraits<D_PAD>::kRowBytes;
    static_assert(BT % kWarps == 0, "BT must be a multiple of the warp count");
    // Lanes per row of the group kernels' MMA row passes over ROWS rows: a warp's rows in one
    // pass, but at most 4 elements of a row per lane
    template <int ROWS>
    static constexpr int kRowLanes = 32 / (ROWS / kWarps) > D_PAD / 4 ? 32 / (ROWS / kWarps)
                                                                      : D_PAD / 4;
};

}  // namespace ttt
