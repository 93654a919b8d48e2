// Native placement kernels for memplan's solvers, called through ctypes (solvers/native.py).
//   mp_greedy: place items (single buffers or rigid contiguous blocks) in a given order, best or first fit.
//   mp_search: decide "fits in capacity?" for interval buffers by a canonical depth-first search
//              (each buffer at the lowest offset its placed neighbours allow, offsets nondecreasing),
//              with section inference, gap dominance and dynamic decomposition into independent parts,
//              one thread per static buffer order.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

typedef long long i64;

namespace {

inline bool active(int i, int S, const i64* alloc, const i64* stream, const i64* release, const i64* size) {
  return size[i] > 0 && alloc[i] < release[(i64)i * S + stream[i]];
}

inline bool conflict(int i, int j, int S, const i64* alloc, const i64* stream, const i64* release) {
  return alloc[j] < release[(i64)i * S + stream[j]] && alloc[i] < release[(i64)j * S + stream[i]];
}

}  // namespace

extern "C" i64 mp_greedy(int n, int S, const i64* alloc, const i64* stream, const i64* release,
                         const i64* size, int m, const int* item_start, const int* members,
                         const i64* rel, const int* order, int best_fit, i64* offsets) {
  // Conflicting buffers overlap on [alloc, latest release). Placed buffers are indexed twice: a segment
  // tree over time finds those live at a point, per-time lists those allocated within a window.
  // Times are compressed to ranks so the index size follows the buffer count, not the time values.
  std::vector<i64> from(n), until(n, 0), times;
  for (int i = 0; i < n; ++i) {
    for (int s = 0; s < S; ++s) until[i] = std::max(until[i], release[(i64)i * S + s]);
    times.push_back(alloc[i]);
    times.push_back(until[i]);
  }
  std::sort(times.begin(), times.end());
  times.erase(std::unique(times.begin(), times.end()), times.end());
  for (int i = 0; i < n; ++i) {
    from[i] = std::lower_bound(times.begin(), times.end(), alloc[i]) - times.begin();
    until[i] = std::lower_bound(times.begin(), times.end(), until[i]) - times.begin();
  }
  const i64 horizon = (i64)times.size() + 1;
  i64 leaves = 1;
  while (leaves < horizon) leaves *= 2;
  std::vector<std::vector<int>> node(2 * leaves), starts(horizon);
  auto add = [&](int i) {
    if (!active(i, S, alloc, stream, release, size)) return;
    for (i64 l = from[i] + leaves, r = until[i] + leaves; l < r; l >>= 1, r >>= 1) {
      if (l & 1) node[l++].push_back(i);
      if (r & 1) node[--r].push_back(i);
    }
    starts[from[i]].push_back(i);
  };
  auto each_overlapping = [&](int b, auto&& visit) {
    for (i64 x = from[b] + leaves; x >= 1; x >>= 1)
      for (const int c : node[x]) visit(c);
    for (i64 t = from[b] + 1; t < until[b]; ++t)
      for (const int c : starts[t]) visit(c);
  };
  for (int i = 0; i < n; ++i)
    if (offsets[i] >= 0) add(i);
  std::vector<std::pair<i64, i64>> forbidden;
  for (int q = 0; q < m; ++q) {
    const int item = order[q];
    forbidden.clear();
    for (int k = item_start[item]; k < item_start[item + 1]; ++k) {
      const int b = members[k];
      if (!active(b, S, alloc, stream, release, size)) continue;
      each_overlapping(b, [&](int c) {
        if (!conflict(b, c, S, alloc, stream, release)) return;
        i64 lo = offsets[c] - rel[k] - size[b] + 1, hi = offsets[c] + size[c] - rel[k];
        if (lo < 0) lo = 0;
        if (hi > lo) forbidden.emplace_back(lo, hi);
      });
    }
    std::sort(forbidden.begin(), forbidden.end());
    i64 cur = 0, best = -1, best_slack = -1;
    for (const auto& f : forbidden) {
      if (f.first > cur) {
        const i64 slack = f.first - cur;
        if (!best_fit) { best = cur; break; }
        if (best < 0 || slack < best_slack) { best = cur; best_slack = slack; }
      }
      if (f.second > cur) cur = f.second;
    }
    const i64 x = best >= 0 ? best : cur;
    for (int k = item_start[item]; k < item_start[item + 1]; ++k) {
      offsets[members[k]] = x + rel[k];
      add(members[k]);
    }
  }
  i64 arena = 0;
  for (int i = 0; i < n; ++i)
    if (size[i] > 0 && offsets[i] + size[i] > arena) arena = offsets[i] + size[i];
  return arena;
}

namespace {

enum Result { FOUND = 1, NOTFOUND = 0, TIMEOUT = -2 };

struct Search {
  int n, nsec;
  const i64* size;
  const int *slo, *shi;
  i64 cap;
  const std::vector<std::vector<int>>* adj;     // shared by all workers: overlapping buffers
  const std::vector<std::vector<int>>* secmem;  // shared by all workers: buffers of each section
  std::vector<i64> minoff, off, sol, floor_, total;
  std::vector<int> rank, cuts, stamp;
  int generation = 0;
  std::chrono::steady_clock::time_point deadline;
  std::atomic<bool>* stop;  // set when another worker has finished
  i64 nodes = 0;

  bool expired() const {
    return stop->load(std::memory_order_relaxed) || std::chrono::steady_clock::now() > deadline;
  }

  struct Part { std::vector<int> buffers; int lo, hi; };
  const i64 *lower, *upper;
  const char* heuristic = "";  // letters: W width (time), A area, T section total, Z size; all descending

  // Ranks the part's buffers by the current heuristic (section totals as they stand now), then searches.
  Result subsolve(const Part& part) {
    const int m = (int)part.buffers.size();
    std::vector<std::pair<std::vector<i64>, int>> keys(m);
    for (int k = 0; k < m; ++k) {
      const int b = part.buffers[k];
      i64 tot = 0;
      for (int s = slo[b]; s < shi[b]; ++s) tot = std::max(tot, total[s]);
      const i64 w = upper[b] - lower[b];
      // An ordering key only: the area saturates instead of overflowing for huge times and sizes.
      const i64 area = w > 0 && size[b] > INT64_MAX / w ? INT64_MAX : w * size[b];
      for (const char* h = heuristic; *h; ++h)
        keys[k].first.push_back(-(*h == 'W' ? w : *h == 'A' ? area : *h == 'T' ? tot : size[b]));
      keys[k].second = b;
    }
    std::sort(keys.begin(), keys.end());
    std::vector<int> saved(m);
    for (int k = 0; k < m; ++k) {
      saved[k] = rank[part.buffers[k]];
      rank[keys[k].second] = k;
    }
    Result r = place_next(part, 0, -1);
    for (int k = 0; k < m; ++k) rank[part.buffers[k]] = saved[k];
    return r;
  }

  // Solves a part: split at boundaries no unplaced buffer crosses, or place its next buffer.
  Result solve(const Part& part, i64 last_off, int last_rank, bool fresh) {
    std::vector<int> cutpoints = {part.lo};
    for (int s = part.lo; s + 1 < part.hi; ++s)
      if (cuts[s] == 0) cutpoints.push_back(s + 1);
    if (cutpoints.size() == 1) return fresh ? subsolve(part) : place_next(part, last_off, last_rank);
    cutpoints.push_back(part.hi);
    for (size_t c = 1; c < cutpoints.size(); ++c) {
      Part sub;
      sub.lo = cutpoints[c - 1];
      sub.hi = cutpoints[c];
      for (int b : part.buffers)
        if (off[b] < 0 && slo[b] < sub.hi && shi[b] > sub.lo) sub.buffers.push_back(b);
      if (sub.buffers.empty()) continue;
      Result r = subsolve(sub);
      if (r != FOUND) return r;
    }
    return FOUND;
  }

  bool check(const Part& part, i64 o) {
    for (int s = part.lo; s < part.hi; ++s)
      if (std::max(o, floor_[s]) + total[s] > cap) return false;
    return true;
  }

  Result place_next(const Part& part, i64 last_off, int last_rank) {
    ++nodes;
    std::vector<std::pair<std::pair<i64, int>, int>> cand;
    i64 min_height = -1;
    for (int b : part.buffers)
      if (off[b] < 0) {
        cand.push_back({{minoff[b], rank[b]}, b});
        const i64 h = minoff[b] + size[b];
        if (min_height < 0 || h < min_height) min_height = h;
      }
    if (cand.empty()) {
      for (int b : part.buffers) sol[b] = off[b];
      return FOUND;
    }
    std::sort(cand.begin(), cand.end());
    for (const auto& cd : cand) {
      const i64 o = cd.first.first;
      const int r = cd.first.second, b = cd.second;
      if (o < last_off || (o == last_off && r < last_rank)) continue;
      if (o >= min_height) break;  // a gap below would fit another buffer entirely: dominated
      if (expired()) return TIMEOUT;
      const i64 top = o + size[b];
      off[b] = o;
      std::vector<std::pair<int, i64>> off_changes, floor_changes;
      std::vector<int> affected;
      ++generation;
      bool hatless = true;  // nothing unplaced overlaps b: its placement constrains no one
      for (int c : (*adj)[b])
        if (off[c] < 0) hatless = false;
      for (int c : (*adj)[b])
        if (off[c] < 0 && minoff[c] < top) {
          off_changes.push_back({c, minoff[c]});
          minoff[c] = top;
          for (int s = slo[c]; s < shi[c]; ++s)
            if (stamp[s] != generation) { stamp[s] = generation; affected.push_back(s); }
        }
      for (int s = slo[b]; s < shi[b]; ++s) {
        floor_changes.push_back({s, floor_[s]});
        floor_[s] = top;
        total[s] -= size[b];
      }
      // A section's floor is at least the lowest offset any of its unplaced buffers can take; computed
      // only when the cheap check passes, then the sections it raised are checked again.
      bool ok = check(part, o);
      if (ok) {
        int visited = 0;
        for (int s : affected) {
          if ((++visited & 63) == 0 && expired()) { ok = false; break; }
          i64 lowest = -1;
          for (int c : (*secmem)[s])
            if (off[c] < 0 && (lowest < 0 || minoff[c] < lowest)) lowest = minoff[c];
          if (lowest > floor_[s]) {
            floor_changes.push_back({s, floor_[s]});
            floor_[s] = lowest;
            if (s >= part.lo && s < part.hi && lowest + total[s] > cap) ok = false;
          }
        }
      }
      Result res = NOTFOUND;
      if (ok) {
        sol[b] = o;
        for (int s = slo[b]; s + 1 < shi[b]; ++s) --cuts[s];
        res = solve(part, o, r, false);
        for (int s = slo[b]; s + 1 < shi[b]; ++s) ++cuts[s];
      }
      for (auto it = floor_changes.rbegin(); it != floor_changes.rend(); ++it) floor_[it->first] = it->second;
      for (int s = slo[b]; s < shi[b]; ++s) total[s] += size[b];
      for (auto it = off_changes.rbegin(); it != off_changes.rend(); ++it) minoff[it->first] = it->second;
      off[b] = -1;
      if (res != NOTFOUND) return res;
      if (expired()) return TIMEOUT;
      if (hatless) break;  // the other candidates lead to the same failure
    }
    return NOTFOUND;
  }
};

}  // namespace

// Buffers are live on [lower, upper), section ranges [slo, shi). Each heuristic (a static order) runs in
// its own thread; the first to find a placement or prove there is none stops the others.
// Returns 1 (fits; offsets written), 0 (proven not to fit), -2 (time limit). *nodes_out counts nodes.
extern "C" int mp_search(int n, int nsec, const i64* size, const i64* lower, const i64* upper,
                         const int* slo, const int* shi, i64 cap, int nheur, const char* const* heuristics,
                         double seconds, i64* offsets, i64* nodes_out) {
  std::vector<std::vector<int>> adj(n), secmem(nsec);
  std::vector<i64> total(nsec, 0);
  std::vector<int> cuts(nsec, 0);
  for (int b = 0; b < n; ++b) {
    for (int s = slo[b]; s < shi[b]; ++s) { secmem[s].push_back(b); total[s] += size[b]; }
    for (int s = slo[b]; s + 1 < shi[b]; ++s) ++cuts[s];
  }
  *nodes_out = 0;
  for (int s = 0; s < nsec; ++s)
    if (total[s] > cap) return 0;
  for (int b = 0; b < n; ++b)
    for (int c = b + 1; c < n; ++c)
      if (slo[b] < shi[c] && slo[c] < shi[b]) { adj[b].push_back(c); adj[c].push_back(b); }
  Search::Part all;
  all.lo = 0; all.hi = nsec;
  for (int b = 0; b < n; ++b) all.buffers.push_back(b);
  std::atomic<bool> stop(false);
  std::atomic<int> winner(-1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds((i64)(seconds * 1e6));
  std::vector<Search> workers(nheur);
  std::vector<Result> results(nheur, TIMEOUT);
  std::vector<std::thread> threads;
  for (int h = 0; h < nheur; ++h) {
    Search& st = workers[h];
    st.n = n; st.nsec = nsec; st.size = size; st.slo = slo; st.shi = shi; st.cap = cap;
    st.lower = lower; st.upper = upper; st.heuristic = heuristics[h];
    st.adj = &adj; st.secmem = &secmem; st.stop = &stop; st.deadline = deadline;
    st.rank.assign(n, 0); st.minoff.assign(n, 0); st.off.assign(n, -1); st.sol.assign(n, -1);
    st.floor_.assign(nsec, 0); st.total = total; st.cuts = cuts; st.stamp.assign(nsec, 0);
    threads.emplace_back([&, h]() {
      results[h] = workers[h].solve(all, 0, -1, true);
      if (results[h] == FOUND || results[h] == NOTFOUND) {
        int none = -1;
        if (winner.compare_exchange_strong(none, h)) stop.store(true);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& st : workers) *nodes_out += st.nodes;
  const int w = winner.load();
  if (w < 0) return -2;
  if (results[w] == FOUND) for (int b = 0; b < n; ++b) offsets[b] = workers[w].sol[b];
  return results[w] == FOUND ? 1 : 0;
}
