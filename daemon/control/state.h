/*
 * state.h - state kept across daemon restarts in daemon.state_dir: the last expert map accepted by
 * SetExpertMap for each group, with its version, one file per group ("map-<hex of the group name>"),
 * written atomically (temporary file, fsync, rename). A group created after a restart starts from its
 * saved map and version, so versions keep increasing across restarts. Without a state_dir nothing is kept.
 */
#ifndef EPD_STATE_H
#define EPD_STATE_H

#include <stddef.h>

#include "core/engine.h"

/* Use dir ("" = keep nothing), creating it (mode 0750) if needed; 0, or -1 with err set. */
int epd_state_init(const char *dir, char *err, size_t errlen);
void epd_state_fini(void);
/* Save a group's map (atomic replace); 0, or -1 (logged; the map stays in force, only not persisted). */
int epd_state_save_map(const char *group, const epd_expert_map_t *map);
/* Load a group's saved map into out (free with epd_expert_map_free): 1 loaded, 0 none saved, -1 unreadable
 * or corrupt (logged, ignored). */
int epd_state_load_map(const char *group, epd_expert_map_t *out);

#endif
