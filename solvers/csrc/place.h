// Native placement kernels for memplan's solvers, called through ctypes (solvers/native.py mirrors every
// struct here field by field, in the same order):
//   mp_greedy: place items (single buffers or rigid contiguous blocks) in a given order, best or first fit.
//   mp_sweep: place the items mp_greedy left unplaced, in time order, above every placed buffer (linear-ish time).
//   mp_search: decide "fits in capacity?" for interval buffers by a canonical depth-first search.
#pragma once

#include <cstdint>

// The vocabulary: what each integer in the interface counts.
using Bytes = int64_t;         // a size or an offset in the arena, in bytes
using Time = int64_t;          // a point on the problem's clock (allocations, frees, releases)
using StreamId = int64_t;      // a dense stream index, 0 .. streams - 1
using BufferIndex = int32_t;   // a buffer's position in the problem's columns
using ItemIndex = int32_t;     // an item's position: a single buffer, or a contiguous group placed as one block
using MemberIndex = int32_t;   // a position in GreedyProblem::members (an item's members are consecutive)
using SectionIndex = int32_t;  // a section: the span between two consecutive distinct times of the problem
using Work = int64_t;          // elementary steps of a kernel (buffers scanned, neighbours and sections updated):
                               // the deterministic measure of effort, the same on a busy or an idle machine

extern "C" {

// The buffers of a problem on any number of streams, and the items to place over them.
// Buffers i and j conflict when each is allocated before the other stops blocking its stream.
struct GreedyProblem {
  int32_t buffers;                 // how many buffers
  int32_t streams;                 // how many streams
  const Time* alloc;               // alloc[i]: when buffer i is allocated
  const StreamId* stream;          // stream[i]: the stream that allocates and frees buffer i
  const Time* release;             // release[i * streams + s]: first time on stream s ordered after i's free
  const Bytes* size;               // size[i]: buffer i's bytes (0: it takes no room and conflicts with nothing)
  int32_t items;                   // how many items to place
  const MemberIndex* item_start;   // item k is members[item_start[k] .. item_start[k + 1]); items + 1 entries
  const BufferIndex* members;      // every item's buffers, item after item
  const Bytes* member_offset;      // member_offset[j]: where members[j] starts inside its item
  const ItemIndex* order;          // order[q]: the q-th item to place (items entries)
  int32_t best_fit;                // 1: the tightest gap that fits (best fit); 0: the lowest one (first fit)
  Work work_limit;                 // mp_greedy stops before an item once it has spent more steps than this
  double seconds;                  // a wall-clock ceiling for the call: mp_greedy stops when it passes too
};

// mp_greedy's answer when it stopped before placing every item (work_limit or the ceiling).
constexpr int64_t GREEDY_INTERRUPTED = -1;

// Buffers live on one stream over [lower, upper), as section ranges too. Every buffer is active (positive
// size, nonempty lifetime); two buffers conflict exactly when their section ranges overlap.
struct SearchProblem {
  int32_t buffers;                    // how many buffers
  int32_t sections;                   // how many sections (distinct times minus one)
  const Bytes* size;                  // size[i]: buffer i's bytes
  const Time* lower;                  // lower[i]: when buffer i is allocated (its lifetime orders the search)
  const Time* upper;                  // upper[i]: when buffer i is freed
  const SectionIndex* first_section;  // first_section[i]: the first section buffer i is live in
  const SectionIndex* end_section;    // end_section[i]: one past the last section buffer i is live in
  Bytes capacity;                     // every buffer must end at or below this many bytes
  int32_t prefix_length;              // how many buffers the prefix places before the search starts (0: none)
  const BufferIndex* prefix;          // prefix[k]: the k-th buffer placed, each at the lowest offset its placed
                                      //   neighbours leave it; the search then places the rest
  int32_t heuristics;                 // how many static buffer orders to search with, one thread each
  const char* const* heuristic;       // heuristic[h]: sort keys, most significant first, all descending:
                                      //   W lifetime, A area (lifetime x size), T section total, Z size
  Work work_limit;                    // each thread stops after this many steps (the deterministic budget)
  double seconds;                     // a wall-clock ceiling for the whole search, all threads together
};

// What mp_search decided.
enum SearchOutcome : int32_t {
  SEARCH_TIMEOUT = -2,     // the time limit passed first
  SEARCH_INFEASIBLE = 0,   // proven: no placement fits in the capacity (with a prefix: none that completes it)
  SEARCH_FITS = 1,         // a placement fits; its offsets are written
};

// Places problem->items in problem->order, each at the lowest or tightest offset where none of its
// members shares a byte with a conflicting placed buffer. Returns the arena: the top of every buffer of
// positive size; or GREEDY_INTERRUPTED when it passed work_limit or the ceiling first (checked before each
// item, the clock every 2**16 steps): the items placed so far keep their offsets, the others stay at -1.
Bytes mp_greedy(const GreedyProblem* problem,  // the buffers and the items; read only
                Bytes* offsets,                // in: each buffer's preset offset, -1 for those the items place;
                                               // out: every placed member's offset (problem->buffers entries)
                Work* work);                   // out: steps spent (placed neighbours visited, gaps swept)

// Places every item whose members are still at -1 (order, best_fit, work_limit and seconds are not read),
// above the top of every buffer already placed, as an allocator would: the items in order of their
// first allocation, each in the smallest free block that holds it (the lowest of equals), freed blocks
// merged with their free neighbours, at the latest release of any member. O(items log items) however the
// buffers overlap, so it finishes a placement that mp_greedy could not. Returns the arena.
Bytes mp_sweep(const GreedyProblem* problem,  // the buffers and the items; read only
               Bytes* offsets,                // in: placed buffers' offsets, -1 for those still to place;
                                              // out: every buffer's offset
               Work* work);                   // out: steps spent (place.cpp's SWEEP_STEPS per item placed)

// Decides whether problem's buffers fit in problem->capacity by a canonical depth-first search (each
// buffer at the lowest offset its placed neighbours allow, offsets nondecreasing), with section inference,
// gap dominance and dynamic decomposition into independent parts; after the prefix, if one is given, which
// restarts the search from part of an earlier placement. Each heuristic runs in its own thread.
// The answer is the one reached in the fewest steps (ties: the earlier heuristic), so it does not depend
// on how the threads were scheduled: a thread stops once it has spent more steps than a finished one,
// or work_limit. Only the wall-clock ceiling, when it strikes first, makes the outcome machine-dependent.
SearchOutcome mp_search(const SearchProblem* problem,  // the buffers, capacity, orders and limits; read only
                        Bytes* offsets,                // out, on SEARCH_FITS: each buffer's offset (buffers entries)
                        Work* work);                   // out: steps spent, all threads together, counted
                                                       // so that it does not depend on thread timing
}
