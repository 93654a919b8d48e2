// Native placement kernels for memplan's solvers (the interface, its vocabulary and its structs: place.h).
//   mp_greedy: place items (single buffers or rigid contiguous blocks) in a given order, best or first fit.
//   mp_sweep: place the items left unplaced in time order, best fit over a free list, above the placed ones.
//   mp_search: decide "fits in capacity?" for interval buffers by a canonical depth-first search
//              (each buffer at the lowest offset its placed neighbours allow, offsets nondecreasing),
//              with section inference, gap dominance and dynamic decomposition into independent parts,
//              one thread per static buffer order.
#include "place.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace {

// mp_sweep's steps per item, counted as mp_greedy's are: a million items take about a second on the project's
// machine, where the budget counts 3e7 greedy steps a second (solvers/budget.py).
constexpr Work SWEEP_STEPS = 32;
// How many steps mp_greedy takes between two looks at the clock (a look costs about 20 ns).
constexpr Work CLOCK_STEPS = 1 << 16;

// A wall-clock ceiling `seconds` from now (none past a billion seconds: a 30-year one).
std::chrono::steady_clock::time_point ceiling(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::microseconds((int64_t)(std::min(std::max(seconds, 0.0), 1e9) * 1e6));
}

// The latest time `buffer` blocks any stream: it conflicts with no buffer allocated from then on.
inline Time latest_release(const GreedyProblem& problem, BufferIndex buffer) {
  Time latest = 0;
  for (int s = 0; s < problem.streams; ++s)
    latest = std::max(latest, problem.release[(int64_t)buffer * problem.streams + s]);
  return latest;
}

// When `blocker` stops blocking the stream that allocates `buffer`.
inline Time release_for(const GreedyProblem& problem, BufferIndex blocker, BufferIndex buffer) {
  return problem.release[(int64_t)blocker * problem.streams + problem.stream[buffer]];
}

// Takes bytes at some time: positive size and allocated before its own stream may reuse it.
inline bool is_active(const GreedyProblem& problem, BufferIndex buffer) {
  return problem.size[buffer] > 0 && problem.alloc[buffer] < release_for(problem, buffer, buffer);
}

// May not share a byte: each is allocated before the other stops blocking its stream.
inline bool conflicts(const GreedyProblem& problem, BufferIndex first, BufferIndex second) {
  return problem.alloc[second] < release_for(problem, first, second) &&
         problem.alloc[first] < release_for(problem, second, first);
}

// mp_greedy's body (see place.h).
Bytes greedy(const GreedyProblem& problem, Bytes* offsets, Work* work) {
  const int buffers = problem.buffers;
  // Conflicting buffers overlap on [alloc, latest release). Placed buffers are indexed twice: a segment
  // tree over time finds those live at a point, per-time lists those allocated within a window.
  // Times are compressed to ranks so the index size follows the buffer count, not the time values.
  std::vector<Time> until(buffers, 0), times;
  for (int i = 0; i < buffers; ++i) {
    until[i] = latest_release(problem, i);
    times.push_back(problem.alloc[i]);
    times.push_back(until[i]);
  }
  std::sort(times.begin(), times.end());
  times.erase(std::unique(times.begin(), times.end()), times.end());
  std::vector<int64_t> start_rank(buffers), end_rank(buffers);
  for (int i = 0; i < buffers; ++i) {
    start_rank[i] = std::lower_bound(times.begin(), times.end(), problem.alloc[i]) - times.begin();
    end_rank[i] = std::lower_bound(times.begin(), times.end(), until[i]) - times.begin();
  }
  const int64_t horizon = (int64_t)times.size() + 1;
  int64_t leaves = 1;
  while (leaves < horizon) leaves *= 2;
  // tree[node]: placed buffers covering the node's whole rank range; starting_at[rank]: placed buffers
  // whose range starts there.
  std::vector<std::vector<BufferIndex>> tree(2 * leaves), starting_at(horizon);
  auto index_placed = [&](BufferIndex buffer) {
    if (!is_active(problem, buffer)) return;
    for (int64_t left = start_rank[buffer] + leaves, right = end_rank[buffer] + leaves; left < right;
         left >>= 1, right >>= 1) {
      if (left & 1) tree[left++].push_back(buffer);
      if (right & 1) tree[--right].push_back(buffer);
    }
    starting_at[start_rank[buffer]].push_back(buffer);
  };
  // Visits every placed buffer whose range overlaps `buffer`'s: live at its start, or starting inside it.
  *work = 0;
  auto each_overlapping = [&](BufferIndex buffer, auto&& visit) {
    for (int64_t node = start_rank[buffer] + leaves; node >= 1; node >>= 1) {
      *work += 1 + (Work)tree[node].size();
      for (const BufferIndex other : tree[node]) visit(other);
    }
    for (int64_t rank = start_rank[buffer] + 1; rank < end_rank[buffer]; ++rank) {
      *work += 1 + (Work)starting_at[rank].size();
      for (const BufferIndex other : starting_at[rank]) visit(other);
    }
  };
  for (int i = 0; i < buffers; ++i)
    if (offsets[i] >= 0) index_placed(i);
  // The item bases [low, high) that would put a member on bytes of a conflicting placed buffer.
  std::vector<std::pair<Bytes, Bytes>> forbidden;
  const auto deadline = ceiling(problem.seconds);
  Work next_look = 0;  // the step count at which to look at the clock again
  for (int q = 0; q < problem.items; ++q) {
    if (*work > problem.work_limit) return GREEDY_INTERRUPTED;
    if (*work >= next_look) {
      if (std::chrono::steady_clock::now() > deadline) return GREEDY_INTERRUPTED;
      next_look = *work + CLOCK_STEPS;
    }
    const ItemIndex item = problem.order[q];
    forbidden.clear();
    for (MemberIndex k = problem.item_start[item]; k < problem.item_start[item + 1]; ++k) {
      const BufferIndex member = problem.members[k];
      if (!is_active(problem, member)) continue;
      each_overlapping(member, [&](BufferIndex other) {
        if (!conflicts(problem, member, other)) return;
        Bytes low = offsets[other] - problem.member_offset[k] - problem.size[member] + 1;
        const Bytes high = offsets[other] + problem.size[other] - problem.member_offset[k];
        if (low < 0) low = 0;
        if (high > low) forbidden.emplace_back(low, high);
      });
    }
    // Sweep the forbidden ranges from the bottom: each gap between them is a candidate base.
    std::sort(forbidden.begin(), forbidden.end());
    *work += 1 + (Work)forbidden.size();
    Bytes cursor = 0, best = -1, best_slack = -1;
    for (const auto& range : forbidden) {
      if (range.first > cursor) {
        const Bytes slack = range.first - cursor;
        if (!problem.best_fit) { best = cursor; break; }
        if (best < 0 || slack < best_slack) { best = cursor; best_slack = slack; }
      }
      if (range.second > cursor) cursor = range.second;
    }
    const Bytes base = best >= 0 ? best : cursor;  // no gap fits: on top of every forbidden range
    for (MemberIndex k = problem.item_start[item]; k < problem.item_start[item + 1]; ++k) {
      offsets[problem.members[k]] = base + problem.member_offset[k];
      index_placed(problem.members[k]);
    }
  }
  Bytes arena = 0;
  for (int i = 0; i < buffers; ++i)
    if (problem.size[i] > 0 && offsets[i] + problem.size[i] > arena) arena = offsets[i] + problem.size[i];
  return arena;
}

// mp_sweep's body (see place.h).
Bytes sweep(const GreedyProblem& problem, Bytes* offsets, Work* work) {
  // Everything placed already lies below `floor`; the items left go above it.
  Bytes floor = 0;
  for (int i = 0; i < problem.buffers; ++i)
    if (offsets[i] >= 0 && problem.size[i] > 0) floor = std::max(floor, offsets[i] + problem.size[i]);
  // Each item left: its extent, and the span [start, end) over which one of its members blocks another
  // buffer; buffers whose spans are disjoint never conflict (conflicts() implies the spans overlap).
  struct Left {
    Time start, end;
    Bytes extent;
    ItemIndex item;
  };
  std::vector<Left> left;
  *work = 0;
  for (ItemIndex item = 0; item < problem.items; ++item) {
    const MemberIndex first = problem.item_start[item], last = problem.item_start[item + 1];
    if (first == last || offsets[problem.members[first]] >= 0) continue;
    Left entry{0, 0, 0, item};
    bool active = false;
    for (MemberIndex k = first; k < last; ++k) {
      const BufferIndex member = problem.members[k];
      entry.extent = std::max(entry.extent, problem.member_offset[k] + problem.size[member]);
      if (!is_active(problem, member)) continue;
      entry.start = active ? std::min(entry.start, problem.alloc[member]) : problem.alloc[member];
      entry.end = std::max(entry.end, latest_release(problem, member));
      active = true;
    }
    if (!active) {  // takes no bytes at any time: at the bottom, like mp_greedy puts it
      for (MemberIndex k = first; k < last; ++k) offsets[problem.members[k]] = problem.member_offset[k];
      continue;
    }
    left.push_back(entry);
  }
  // Allocations in order of their start, frees in order of their end (the position in `left` breaks ties, so
  // the result does not depend on the sort), merged with frees first at equal times: a span ending at t
  // frees its block for one starting at t.
  std::vector<std::pair<Time, size_t>> starts(left.size()), ends(left.size());
  for (size_t k = 0; k < left.size(); ++k) {
    starts[k] = {left[k].start, k};
    ends[k] = {left[k].end, k};
  }
  std::sort(starts.begin(), starts.end());
  std::sort(ends.begin(), ends.end());
  *work += SWEEP_STEPS * (Work)left.size();
  std::map<Bytes, Bytes> free_at;                 // free blocks: offset -> length (disjoint, never adjacent)
  std::set<std::pair<Bytes, Bytes>> free_by_size;  // the same blocks: (length, offset)
  std::vector<Bytes> base(left.size(), -1);
  Bytes top = floor;  // where the heap ends: free blocks lie below it
  auto add_free = [&](Bytes at, Bytes length) {
    auto next = free_at.lower_bound(at);
    if (next != free_at.end() && next->first == at + length) {  // merge with the block above
      length += next->second;
      free_by_size.erase({next->second, next->first});
      next = free_at.erase(next);
    }
    if (next != free_at.begin()) {
      auto below = std::prev(next);
      if (below->first + below->second == at) {  // merge with the block below
        free_by_size.erase({below->second, below->first});
        at = below->first;
        length += below->second;
        free_at.erase(below);
      }
    }
    if (at + length == top) {  // the top of the heap: give it back
      top = at;
      return;
    }
    free_at[at] = length;
    free_by_size.insert({length, at});
  };
  for (size_t next_start = 0, next_end = 0; next_start < starts.size();) {
    if (ends[next_end].first <= starts[next_start].first) {  // every span ends after it starts: never past the end
      const size_t k = ends[next_end++].second;
      add_free(base[k], left[k].extent);
      continue;
    }
    const size_t k = starts[next_start++].second;
    auto fit = free_by_size.lower_bound({left[k].extent, INT64_MIN});
    if (fit != free_by_size.end()) {
      const Bytes at = fit->second, length = fit->first;
      free_by_size.erase(fit);
      free_at.erase(at);
      if (length > left[k].extent) {
        free_at[at + left[k].extent] = length - left[k].extent;
        free_by_size.insert({length - left[k].extent, at + left[k].extent});
      }
      base[k] = at;
    } else {
      base[k] = top;
      top += left[k].extent;
    }
  }
  for (size_t k = 0; k < left.size(); ++k)
    for (MemberIndex m = problem.item_start[left[k].item]; m < problem.item_start[left[k].item + 1]; ++m)
      offsets[problem.members[m]] = base[k] + problem.member_offset[m];
  Bytes top_of_all = 0;
  for (int i = 0; i < problem.buffers; ++i)
    if (problem.size[i] > 0 && offsets[i] + problem.size[i] > top_of_all) top_of_all = offsets[i] + problem.size[i];
  return top_of_all;
}

// One worker of mp_search: a depth-first search over canonical placements with one static buffer order.
struct Search {
  // The problem, shared read only by every worker.
  const Bytes* size;
  const Time *lower, *upper;
  const SectionIndex *first_section, *end_section;
  Bytes capacity;
  const std::vector<std::vector<BufferIndex>>* neighbours;       // buffers whose section ranges overlap
  const std::vector<std::vector<BufferIndex>>* section_members;  // buffers live in each section
  const char* heuristic = "";  // sort keys, all descending: W lifetime, A area, T section total, Z size
  Work work_limit;                                 // this worker's budget of steps
  std::chrono::steady_clock::time_point deadline;  // the wall-clock ceiling
  std::atomic<Work>* decided;  // the fewest steps in which some worker has finished (it cannot be beaten past it)

  // This worker's state.
  std::vector<Bytes> lowest_offset;   // per buffer: the lowest offset its placed neighbours leave it
  std::vector<Bytes> offset;          // per buffer: its offset on the current path, -1 when unplaced
  std::vector<Bytes> solution;        // per buffer: its offset in the placement found
  std::vector<Bytes> section_floor;   // per section: no unplaced buffer in it can sit lower
  std::vector<Bytes> unplaced_bytes;  // per section: the bytes of its unplaced buffers
  std::vector<int> rank;              // per buffer: its position in the current part's order
  std::vector<int> crossing;          // per section boundary s | s + 1: unplaced buffers live across it
  std::vector<int> stamp;             // per section: the generation that last listed it as affected
  int generation = 0;
  Work work = 0;  // steps spent so far

  // A set of buffers independent of the others, live within sections [first_section, end_section).
  struct Part {
    std::vector<BufferIndex> buffers;
    SectionIndex first_section, end_section;
  };

  // Past the budget, past a finished worker's step count, or past the ceiling. Monotone: once true, stays true.
  bool expired() const {
    return work > work_limit || work > decided->load(std::memory_order_relaxed) ||
           std::chrono::steady_clock::now() > deadline;
  }

  // Ranks the part's buffers by the current heuristic (section totals as they stand now), then searches.
  SearchOutcome rank_and_solve(const Part& part) {
    const int count = (int)part.buffers.size();
    std::vector<std::pair<std::vector<int64_t>, BufferIndex>> keys(count);
    for (int k = 0; k < count; ++k) {
      const BufferIndex buffer = part.buffers[k];
      Bytes section_total = 0;
      work += 1 + (end_section[buffer] - first_section[buffer]);
      for (SectionIndex s = first_section[buffer]; s < end_section[buffer]; ++s)
        section_total = std::max(section_total, unplaced_bytes[s]);
      const Time width = upper[buffer] - lower[buffer];
      // An ordering key only: the area saturates instead of overflowing for huge times and sizes.
      const int64_t area = width > 0 && size[buffer] > INT64_MAX / width ? INT64_MAX : width * size[buffer];
      for (const char* letter = heuristic; *letter; ++letter)
        keys[k].first.push_back(-(*letter == 'W'   ? width
                                  : *letter == 'A' ? area
                                  : *letter == 'T' ? section_total
                                                   : size[buffer]));
      keys[k].second = buffer;
    }
    std::sort(keys.begin(), keys.end());
    std::vector<int> saved(count);
    for (int k = 0; k < count; ++k) {
      saved[k] = rank[part.buffers[k]];
      rank[keys[k].second] = k;
    }
    const SearchOutcome outcome = place_next(part, 0, -1);
    for (int k = 0; k < count; ++k) rank[part.buffers[k]] = saved[k];
    return outcome;
  }

  // Solves a part: split at boundaries no unplaced buffer crosses, or place its next buffer.
  SearchOutcome solve(const Part& part, Bytes last_offset, int last_rank, bool fresh) {
    std::vector<SectionIndex> cutpoints = {part.first_section};
    work += 1 + (part.end_section - part.first_section);
    for (SectionIndex s = part.first_section; s + 1 < part.end_section; ++s)
      if (crossing[s] == 0) cutpoints.push_back(s + 1);
    if (cutpoints.size() == 1) return fresh ? rank_and_solve(part) : place_next(part, last_offset, last_rank);
    cutpoints.push_back(part.end_section);
    for (size_t c = 1; c < cutpoints.size(); ++c) {
      Part sub;
      work += (Work)part.buffers.size();
      sub.first_section = cutpoints[c - 1];
      sub.end_section = cutpoints[c];
      for (const BufferIndex buffer : part.buffers)
        if (offset[buffer] < 0 && first_section[buffer] < sub.end_section && end_section[buffer] > sub.first_section)
          sub.buffers.push_back(buffer);
      if (sub.buffers.empty()) continue;
      const SearchOutcome outcome = rank_and_solve(sub);
      if (outcome != SEARCH_FITS) return outcome;
    }
    return SEARCH_FITS;
  }

  // Whether every section of the part still fits its unplaced bytes above max(bottom, its floor).
  bool sections_fit(const Part& part, Bytes bottom) {
    work += part.end_section - part.first_section;
    for (SectionIndex s = part.first_section; s < part.end_section; ++s)
      if (std::max(bottom, section_floor[s]) + unplaced_bytes[s] > capacity) return false;
    return true;
  }

  // What placing one buffer changed, so that it can be undone.
  struct Placement {
    BufferIndex buffer;
    std::vector<std::pair<BufferIndex, Bytes>> offset_changes;  // (unplaced neighbour, its lowest offset before)
    std::vector<std::pair<SectionIndex, Bytes>> floor_changes;  // (section, its floor before)
  };

  // Places `buffer` at `at`: raises its unplaced neighbours' lowest offsets and the sections' floors. Returns
  // whether every section of the part still fits its unplaced bytes above max(bottom, its floor), where
  // `bottom` is the offset no unplaced buffer may go below (the canonical order's last offset, or 0).
  bool place(const Part& part, BufferIndex buffer, Bytes at, Bytes bottom, Placement& placement) {
    const Bytes top = at + size[buffer];
    placement.buffer = buffer;
    offset[buffer] = at;
    std::vector<SectionIndex> affected;
    ++generation;
    work += 8 + 2 * (Work)(*neighbours)[buffer].size() + (end_section[buffer] - first_section[buffer]);
    for (const BufferIndex neighbour : (*neighbours)[buffer])
      if (offset[neighbour] < 0 && lowest_offset[neighbour] < top) {
        placement.offset_changes.push_back({neighbour, lowest_offset[neighbour]});
        lowest_offset[neighbour] = top;
        for (SectionIndex s = first_section[neighbour]; s < end_section[neighbour]; ++s)
          if (stamp[s] != generation) { stamp[s] = generation; affected.push_back(s); }
      }
    for (SectionIndex s = first_section[buffer]; s < end_section[buffer]; ++s) {
      placement.floor_changes.push_back({s, section_floor[s]});
      section_floor[s] = top;
      unplaced_bytes[s] -= size[buffer];
    }
    for (SectionIndex s = first_section[buffer]; s + 1 < end_section[buffer]; ++s) --crossing[s];
    // A section's floor is at least the lowest offset any of its unplaced buffers can take; computed
    // only when the cheap check passes, then the sections it raised are checked again.
    if (!sections_fit(part, bottom)) return false;
    int visited = 0;
    for (const SectionIndex s : affected) {
      if ((++visited & 63) == 0 && expired()) return false;
      work += 1 + (Work)(*section_members)[s].size();
      Bytes lowest = -1;
      for (const BufferIndex member : (*section_members)[s])
        if (offset[member] < 0 && (lowest < 0 || lowest_offset[member] < lowest)) lowest = lowest_offset[member];
      if (lowest > section_floor[s]) {
        placement.floor_changes.push_back({s, section_floor[s]});
        section_floor[s] = lowest;
        if (s >= part.first_section && s < part.end_section && lowest + unplaced_bytes[s] > capacity) return false;
      }
    }
    return true;
  }

  // Undoes place(): the state is as before it.
  void unplace(const Placement& placement) {
    const BufferIndex buffer = placement.buffer;
    for (auto it = placement.floor_changes.rbegin(); it != placement.floor_changes.rend(); ++it)
      section_floor[it->first] = it->second;
    for (SectionIndex s = first_section[buffer]; s < end_section[buffer]; ++s) unplaced_bytes[s] += size[buffer];
    for (SectionIndex s = first_section[buffer]; s + 1 < end_section[buffer]; ++s) ++crossing[s];
    for (auto it = placement.offset_changes.rbegin(); it != placement.offset_changes.rend(); ++it)
      lowest_offset[it->first] = it->second;
    offset[buffer] = -1;
  }

  // Tries each unplaced buffer of the part at its lowest offset, in canonical order (offsets
  // nondecreasing, ties by rank), and recurses.
  SearchOutcome place_next(const Part& part, Bytes last_offset, int last_rank) {
    work += 256 + (Work)part.buffers.size();  // a node allocates and sorts its candidates: a fixed cost too
    std::vector<std::pair<std::pair<Bytes, int>, BufferIndex>> candidates;  // ((offset, rank), buffer)
    Bytes min_height = -1;
    for (const BufferIndex buffer : part.buffers)
      if (offset[buffer] < 0) {
        candidates.push_back({{lowest_offset[buffer], rank[buffer]}, buffer});
        const Bytes height = lowest_offset[buffer] + size[buffer];
        if (min_height < 0 || height < min_height) min_height = height;
      }
    if (candidates.empty()) {
      for (const BufferIndex buffer : part.buffers) solution[buffer] = offset[buffer];
      return SEARCH_FITS;
    }
    std::sort(candidates.begin(), candidates.end());
    for (const auto& candidate : candidates) {
      const Bytes at = candidate.first.first;
      const int buffer_rank = candidate.first.second;
      const BufferIndex buffer = candidate.second;
      if (at < last_offset || (at == last_offset && buffer_rank < last_rank)) continue;
      if (at >= min_height) break;  // a gap below would fit another buffer entirely: dominated
      if (expired()) return SEARCH_TIMEOUT;
      bool hatless = true;  // nothing unplaced overlaps the buffer: its placement constrains no one
      for (const BufferIndex neighbour : (*neighbours)[buffer])
        if (offset[neighbour] < 0) hatless = false;
      Placement placement;
      SearchOutcome outcome = SEARCH_INFEASIBLE;
      if (place(part, buffer, at, at, placement)) {
        solution[buffer] = at;
        outcome = solve(part, at, buffer_rank, false);
      }
      unplace(placement);
      if (outcome != SEARCH_INFEASIBLE) return outcome;
      if (expired()) return SEARCH_TIMEOUT;
      if (hatless) break;  // the other candidates lead to the same failure
    }
    return SEARCH_INFEASIBLE;
  }

  // Places the prefix's buffers first, in its order, each at the lowest offset its placed neighbours leave
  // it, then searches the rest of the part from offset 0. With a prefix, SEARCH_INFEASIBLE only says that
  // no placement of the rest completes this one.
  SearchOutcome solve_after(const Part& part, const BufferIndex* prefix, int32_t prefix_length) {
    for (int32_t k = 0; k < prefix_length; ++k) {
      const BufferIndex buffer = prefix[k];
      Placement placement;  // kept: the prefix is never undone
      if (!place(part, buffer, lowest_offset[buffer], 0, placement))
        return expired() ? SEARCH_TIMEOUT : SEARCH_INFEASIBLE;
      solution[buffer] = offset[buffer];
    }
    Part rest;
    rest.first_section = part.first_section;
    rest.end_section = part.end_section;
    for (const BufferIndex buffer : part.buffers)
      if (offset[buffer] < 0) rest.buffers.push_back(buffer);
    return solve(rest, 0, -1, true);
  }
};

// mp_search's body (see place.h).
SearchOutcome search(const SearchProblem& problem, Bytes* offsets, Work* work) {
  const int buffers = problem.buffers, sections = problem.sections;
  std::vector<std::vector<BufferIndex>> neighbours(buffers), section_members(sections);
  std::vector<Bytes> unplaced_bytes(sections, 0);
  std::vector<int> crossing(sections, 0);
  // Building the sections' lists and the neighbour lists is work too: on thousands of buffers it costs
  // more than a short search, and the budget must see it so that many short searches stay within it.
  Work setup = sections + (Work)buffers * (buffers - 1) / 2;
  for (BufferIndex b = 0; b < buffers; ++b) {
    setup += 1 + 2 * (Work)(problem.end_section[b] - problem.first_section[b]);
    for (SectionIndex s = problem.first_section[b]; s < problem.end_section[b]; ++s) {
      section_members[s].push_back(b);
      unplaced_bytes[s] += problem.size[b];
    }
    for (SectionIndex s = problem.first_section[b]; s + 1 < problem.end_section[b]; ++s) ++crossing[s];
  }
  *work = setup;
  for (SectionIndex s = 0; s < sections; ++s)
    if (unplaced_bytes[s] > problem.capacity) return SEARCH_INFEASIBLE;
  for (BufferIndex b = 0; b < buffers; ++b)
    for (BufferIndex c = b + 1; c < buffers; ++c)
      if (problem.first_section[b] < problem.end_section[c] && problem.first_section[c] < problem.end_section[b]) {
        neighbours[b].push_back(c);
        neighbours[c].push_back(b);
      }
  Search::Part all;
  all.first_section = 0;
  all.end_section = sections;
  for (BufferIndex b = 0; b < buffers; ++b) all.buffers.push_back(b);
  std::atomic<Work> decided(INT64_MAX);
  const auto deadline = ceiling(problem.seconds);
  std::vector<Search> workers(problem.heuristics);
  std::vector<SearchOutcome> outcomes(problem.heuristics, SEARCH_TIMEOUT);
  std::vector<std::thread> threads;
  for (int h = 0; h < problem.heuristics; ++h) {
    Search& worker = workers[h];
    worker.size = problem.size;
    worker.lower = problem.lower;
    worker.upper = problem.upper;
    worker.first_section = problem.first_section;
    worker.end_section = problem.end_section;
    worker.capacity = problem.capacity;
    worker.neighbours = &neighbours;
    worker.section_members = &section_members;
    worker.heuristic = problem.heuristic[h];
    worker.work_limit = problem.work_limit;
    worker.deadline = deadline;
    worker.decided = &decided;
    worker.lowest_offset.assign(buffers, 0);
    worker.offset.assign(buffers, -1);
    worker.solution.assign(buffers, -1);
    worker.section_floor.assign(sections, 0);
    worker.unplaced_bytes = unplaced_bytes;
    worker.rank.assign(buffers, 0);
    worker.crossing = crossing;
    worker.stamp.assign(sections, 0);
    threads.emplace_back([&, h]() {
      outcomes[h] = workers[h].solve_after(all, problem.prefix, problem.prefix_length);
      if (outcomes[h] == SEARCH_TIMEOUT) return;
      Work fewest = decided.load();
      while (workers[h].work < fewest && !decided.compare_exchange_weak(fewest, workers[h].work)) {
      }
    });
  }
  for (auto& thread : threads) thread.join();
  // The winner: the finished worker with the fewest steps, the earlier heuristic on a tie. Every worker that
  // finished within the winner's steps ran to its end, so the choice does not depend on thread timing.
  // The steps counted: the winner's, once per worker (each ran at least that far; how much further a loser
  // ran before it noticed depends on timing), or every worker's own when none finished.
  int won = -1;
  for (int h = 0; h < problem.heuristics; ++h) {
    *work += workers[h].work;
    if (outcomes[h] != SEARCH_TIMEOUT && (won < 0 || workers[h].work < workers[won].work)) won = h;
  }
  if (won < 0) return SEARCH_TIMEOUT;
  *work = setup + workers[won].work * problem.heuristics;
  if (outcomes[won] == SEARCH_FITS)
    for (BufferIndex b = 0; b < buffers; ++b) offsets[b] = workers[won].solution[b];
  return outcomes[won];
}

}  // namespace

extern "C" Bytes mp_greedy(const GreedyProblem* problem, Bytes* offsets, Work* work) {
  return greedy(*problem, offsets, work);
}

extern "C" Bytes mp_sweep(const GreedyProblem* problem, Bytes* offsets, Work* work) {
  return sweep(*problem, offsets, work);
}

extern "C" SearchOutcome mp_search(const SearchProblem* problem, Bytes* offsets, Work* work) {
  return search(*problem, offsets, work);
}
